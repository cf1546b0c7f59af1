"""The AReaL tests run in the AReaL venv (`make test-areal`: AReaL 1.0.4 pins torch<2.11 and transformers<=5.3.0).

Every test module here imports AReaL at its top, so where AReaL is not installed (the main .venv's `make test`
session) they are not collected: a conftest-level `pytest.importorskip` would stop that whole session instead.
The thread variables are set by tests/conftest.py before torch is imported.
"""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("areal") is not None else ["test_*.py"]
