"""Benchmarks behind `routereplay bench`: each suite returns a JSON-able record of medians.

Files:
- `codec.py`              Codec benchmark: bytes per (token, layer) row and throughput, against the engines'
                          own forms
- `colocated_options.py`  Replay options benchmark, vLLM variant: the same options against the in-process vLLM
                          CPU engine's log-probs and routes, with its captured combine weights
- `conditions.py`         What a suite ran under: the thread policy applied, the load average at its start and
                          end, other processes' busy cores, its duration; a missed rate target on a busy machine
- `config.py`             The fields every benchmark config starts with (repeats, seed; routing; samples) and
                          their checks
- `delivery/`             Delivery benchmark: a batch's routes from the driver to each rank, compact against
                          dense (`delivery/__init__.py` lists its files)
- `engine.py`             Engine benchmark: what route capture costs the built-in engine's generation
- `environment.py`        Facts about this machine and its packages, for `routereplay env` and benchmark
                          records
- `fully_async.py`        Fully-async GRPO benchmark: resume-route policies side by side, and async against
                          sync throughput
- `indexer.py`            Indexer benchmark: compact DSA indexer choices against the dense
                          int32 form
- `layout.py`             Layout benchmark: pack + Ulysses-shard a padded batch of routes, vectorised vs
                          framework glue
- `load.py`               Load benchmark: the demo's CPU paths on a quiet machine and with busy processes
                          sharing the cores
- `options.py`            Replay options benchmark: what each replay option (ids, ids + weights, threshold)
                          does to the engine / trainer mismatch on the demo
- `record.py`             BENCHMARKS.md and the README benchmark table, written from the records of
                          `routereplay bench all`
- `replay.py`             Replay benchmark: forward + backward time of a training step with routers off,
                          recording, replaying
- `skyrl_routes.py`       SkyRL benchmark: bytes per sample of a batch's routes, compact blobs against SkyRL's
                          wire envelope, generator array and packed batch field
- `store.py`              Store benchmark: driver memory of a batch's routes, compact `RouteStore` vs int16
                          holders
- `timing.py`             Repeated timing with median and spread: the only way figures in BENCHMARKS.md are
                          measured
- `verl_routes.py`        verl benchmark: bytes per sample of a batch's routes, compact blobs against verl's
                          dense and jagged int16
- `vllm.py`               vLLM benchmark: what route capture costs a real vLLM, what forcing a resumed
                          prefix costs, and how long a colocated weight sync takes
"""
