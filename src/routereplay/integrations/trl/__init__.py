"""Router replay for TRL 1.16's `GRPOTrainer`: `RouterReplayGRPOTrainer` with R2 / R3 (docs/trl.md).

    from routereplay.integrations.trl import RouterReplayGRPOTrainer

Files:
- `trainer.py`    `RouterReplayGRPOTrainer`: TRL's `GRPOTrainer` with `router_replay="R2" | "R3"`; `import_trl`
                  refuses a missing or older TRL, naming the extra (`pip install 'routereplay[trl]'`)
- `state.py`      what the trainer keeps between TRL's phases, and the routing each pass runs under
- `layout.py`     generation routes laid out the way TRL pads its batch
- `colocated.py`  TRL's colocated vLLM (`vllm_mode="colocate"`) built with route capture on

Only `trainer.py` and `colocated.py` import TRL. This package imports them on first use of a name it
exports, so `state.py` and `layout.py` import (and are tested) without TRL, and
`from routereplay.integrations.trl import RouterReplayGRPOTrainer` without TRL raises
`MissingDependencyError` naming the extra.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from routereplay.integrations.trl.trainer import INSTALL_HINT, RouterReplayGRPOTrainer, import_trl

__all__ = ["INSTALL_HINT", "RouterReplayGRPOTrainer", "import_trl"]


def __getattr__(name: str) -> Any:
    """The trainer's names, imported (with TRL, checked) the first time one is asked for."""
    if name in __all__:
        from routereplay.integrations.trl import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
