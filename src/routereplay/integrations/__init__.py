"""Router replay inside other frameworks' RL trainers.

Each integration imports the core and its framework, never the other way round, and imports the
framework lazily behind an extra: `routereplay.integrations.trl.RouterReplayGRPOTrainer` needs
`pip install 'routereplay[trl]'` and raises `MissingDependencyError` naming it when TRL is absent.
This package itself imports nothing.

Files:
- `trl/`: `RouterReplayGRPOTrainer`, TRL's `GRPOTrainer` with R2 / R3 (`trl/__init__.py` lists its files).
- `verl/`: verl 0.9.1: rollout routes decoded and merged without zero padding, compact on the batch, and
  R2 / R3 on verl's FSDP/FSDP2 engine (`fsdp_engine`, turned on by `external_lib`); extra `verl`.
- `opt_out`: `env_opt_out`, the environment switch by which verl's and SkyRL's trainers opt out of a token check.
- `framework`: importing an integration's framework (Ray, TRL), refusing one that is absent or too old.
- `ray_routes`: per-rank route bundles through Ray's object store (`put_bundles` / `fetch_bundle`, and
  `RouteSource`, a rollout worker's `RouteStore` behind an actor that cuts each rank its rows); extra `ray`.
"""

__all__: list[str] = []
