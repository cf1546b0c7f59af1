"""The AReaL tests' gate: they run in the AReaL venv (`make test-areal`: AReaL 1.0.4 pins torch<2.11 and
transformers<=5.3.0); in a venv without AReaL (the main .venv, whole suite or `pytest tests/integrations/areal`)
they skip cleanly.

Two parts, both keyed on whether `areal` is importable:
- tests that need AReaL carry the `areal` marker, which tests/conftest.py (the one place where markers turn into
  skips) skips with its reason where AReaL is missing; the AReaL-free tests (the columns' reader, the token check,
  the Ulysses slice) run everywhere;
- the modules that import AReaL at their top (`AREAL_AT_IMPORT`) cannot even be collected without it, so they are
  left out of collection there (`collect_ignore_glob`); a conftest-level `pytest.importorskip` would instead stop a
  session that names this folder.
The thread variables are set by tests/conftest.py before torch is imported.
"""

from __future__ import annotations

import importlib.util

AREAL_AT_IMPORT = ("test_backend.py", "test_episode_routes.py", "test_workflows.py", "test_end_to_end.py")

collect_ignore_glob = [] if importlib.util.find_spec("areal") is not None else list(AREAL_AT_IMPORT)
