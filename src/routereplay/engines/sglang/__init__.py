"""The routereplay SGLang plugin (built against SGLang 0.5.23), loaded by SGLang's own `load_plugins()`.

Files:
- `plugin.py`      the `sglang.srt.plugins` entry point (`register`), `install(registry)` for a given registry
- `retraction.py`  sampling-time routes across retraction: rows kept at `release_req`, written back at finish
- `forcing/`       route forcing: forced routes in `custom_params`, checked, substituted before capture

Importing this package does not import SGLang; the hooks import it when they run. docs/sglang.md has the versions,
what is forced or refused, and what ran where.
"""

from routereplay.engines.sglang.plugin import SGLangPlugin, install, register
from routereplay.engines.sglang.retraction import RetractionStats, SamplingTimeRoutes, SavedRows

__all__ = ["RetractionStats", "SGLangPlugin", "SamplingTimeRoutes", "SavedRows", "install", "register"]
