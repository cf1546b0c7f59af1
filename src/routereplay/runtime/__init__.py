"""The replay runtime: bind an HF MoE model's (or a Megatron-core model's) routers, record and replay
their top-k choice. Importing it never imports megatron.

Files:
- `alignment.py`            Alignment of replay routes with the batch they are applied to: padding side and
                            token ids
- `attachment.py`           How a `Replayer` sits on a model: a forward pre-hook on the model and a `forward`
                            attribute on each bound router scope, both inert stand-ins when pickled or copied
- `binding.py`              What `attach` binds (`Binding`: one router per column of the routes) and the
                            policies it binds them under
- `call_inputs.py`          What a model call hands the Replayer: its batch shape and ids, and the attributes
                            a replayed router call sets
- `discovery.py`            Finding the routers of an HF transformers MoE model, by module, and what to
                            intercept in each
- `family_interceptors.py`  Interceptors of the families that do not select by one top-k over the experts:
                            PhiMoE, Doge
- `gate_weights/`           Weights replay and capture: the combine weights the experts of an HF MoE block
                            receive (`gate_weights/__init__.py` lists its files)
- `indexer/`                `IndexerReplayer`: record and replay DeepSeek Sparse Attention (DSA) indexers'
                            top-k (`indexer/__init__.py` lists its files)
- `interception.py`         Intercepting the one selection `torch.topk` of a router while its forward runs
- `megatron/`               `attach_megatron(model) -> MegatronReplayer`: record and replay the routing of a
                            Megatron-core MoE model (`megatron/__init__.py` lists its files)
- `modality.py`             Modality routers: a layer whose tokens go to one of several routers by their
                            modality
- `replayer.py`             `attach(model) -> Replayer`: record and replay the routing of an HF transformers
                            MoE model
- `routes.py`               Batch routes <-> per-sequence traces, and the checks a replay batch must pass
- `set_order.py`            Set order in replay: a forced set in the live router's order, and its fast path
- `tensor_forms.py`         Which tensors, arrays and numbers replay and record take as arguments, checked
                            before anything reads them
- `threshold.py`            Threshold replay: force an engine's row only where the trainer's own router nearly
                            agrees with it
- `session.py`              One record or replay context of a `Replayer`: its state, what it captured, and
                            the counters
"""

from routereplay.runtime.discovery import Refusal, RouterSite
from routereplay.runtime.indexer import IndexerRecording, IndexerReplayer, IndexerStats
from routereplay.runtime.megatron import MegatronRecording, MegatronReplayer, attach_megatron
from routereplay.runtime.replayer import AuxLossRouting, Binding, JitterPolicy, Recording, Replayer, ReplayStats, attach

__all__ = [
    "AuxLossRouting",
    "Binding",
    "IndexerRecording",
    "IndexerReplayer",
    "IndexerStats",
    "JitterPolicy",
    "MegatronRecording",
    "MegatronReplayer",
    "Recording",
    "Refusal",
    "ReplayStats",
    "Replayer",
    "RouterSite",
    "attach",
    "attach_megatron",
]
