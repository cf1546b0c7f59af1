"""`routereplay bench delivery`: a batch's routes from the driver to each rank, compact against dense.

Files:
- `benchmark.py`  the suite: random-access decode of one sample, per-rank bundles against a dense broadcast
                  over gloo, and vLLM responses to every rank's tensor; `run` and `markdown`
- `job.py`        `DeliveryJob`: one batch's routes delivered to every rank of a real gloo job, compact vs
                  dense
- `pipeline.py`   `ResponsePipeline`: vLLM HTTP response bodies to every rank's replay-ready tensor, stage by
                  stage
"""

from routereplay.bench.delivery.benchmark import DeliveryBenchConfig, markdown, run
from routereplay.bench.delivery.job import DeliveryJob
from routereplay.bench.delivery.pipeline import ResponsePipeline

__all__ = ["DeliveryBenchConfig", "DeliveryJob", "ResponsePipeline", "markdown", "run"]
