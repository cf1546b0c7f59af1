"""The AReaL tests run in the AReaL venv (`make test-areal`); elsewhere they are collected and skipped.
The thread variables are set by tests/conftest.py before torch is imported."""

from __future__ import annotations

import pytest

pytest.importorskip("areal")
