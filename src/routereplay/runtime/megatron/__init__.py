"""Router replay for Megatron-core MoE models: `attach_megatron(model) -> MegatronReplayer`.

Importing it never imports megatron: the replayer takes Megatron's `TopKRouter` instances as it finds them.

Files:
- `replayer.py`  `attach_megatron(model) -> MegatronReplayer`: record and replay the routing of a
                 Megatron-core MoE model through each router's `router_replay` slot
- `binding.py`   Finding the TopKRouters of Megatron-core model chunks, and what a replay payload's layers mean
- `schedule.py`  One record/replay context: the schedule it consumes and what it routed (`MegatronRecording`)
"""

from routereplay.runtime.megatron.replayer import MegatronReplayer, attach_megatron
from routereplay.runtime.megatron.schedule import MegatronRecording

__all__ = ["MegatronRecording", "MegatronReplayer", "attach_megatron"]
