"""Route forcing on vLLM 0.31-0.33's Model Runner V2 (MRv2): the worker side of the routereplay plugin.

Files:
- `row_map.py`  which token rows of an MRv2 step are forced, to which experts: `InputBatch` rows mapped
                to (request, position), requests' forced routes kept by request id
- `runner.py`   the version dispatch (`forcing_path`) and the hooks on MRv2's `GPUModelRunner`: start-up
                checks and buffers in `load_model`, requests in `execute_model`, rows after `prepare_inputs`
- `refusals.py` the set-ups forcing cannot serve (monolithic MoE kernels, speculative decoding, data
                parallel, ...), named with their fix (`ForcingSetupError`)

Importing this package does not import vLLM.
"""

from routereplay.engines.vllm.mrv2.refusals import (
    FORCING_ENV,
    MODULAR_BACKENDS,
    config_problems,
    forcing_enabled,
    kernel_name,
    kernel_problem,
    kernel_problems,
    refuse,
)
from routereplay.engines.vllm.mrv2.row_map import ForcedStep, RowMap
from routereplay.engines.vllm.mrv2.runner import (
    PATCHED_MARK,
    RUNNER_ATTR,
    SERVED_VERSIONS,
    ForcingPath,
    MRv2Forcing,
    forcing_path,
    install,
    is_installed,
    runner_counters,
    wrap_once,
)

__all__ = [
    "FORCING_ENV",
    "MODULAR_BACKENDS",
    "PATCHED_MARK",
    "RUNNER_ATTR",
    "SERVED_VERSIONS",
    "ForcedStep",
    "ForcingPath",
    "MRv2Forcing",
    "RowMap",
    "config_problems",
    "forcing_enabled",
    "forcing_path",
    "install",
    "is_installed",
    "kernel_name",
    "kernel_problem",
    "kernel_problems",
    "refuse",
    "runner_counters",
    "wrap_once",
]
