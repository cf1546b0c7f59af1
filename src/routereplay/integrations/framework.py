"""Importing the framework an integration drives: present, and not older than the integration needs.

Each integration imports its framework (Ray, TRL) only when one of its functions runs; a missing or
too-old framework is a `MissingDependencyError` naming the module that needs it, the version found
and the extra that installs it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from types import ModuleType

from routereplay.errors import MissingDependencyError


@dataclass(frozen=True, slots=True, kw_only=True)
class Framework:
    module: str  # the import name, and the distribution whose version is read ("ray", "trl")
    label: str  # how messages name it ("Ray", "TRL")
    oldest: tuple[int, int]  # major, minor
    needed_by: str  # the routereplay module that needs it
    requirement: str  # why `oldest`: "needs Ray >= 2.40"
    install_hint: str  # "pip install 'routereplay[ray]'"

    def imported(self) -> tuple[ModuleType, str]:
        """The framework's module and installed version; `MissingDependencyError` when absent or too old."""
        try:
            module = importlib.import_module(self.module)
        except ImportError as exc:
            raise MissingDependencyError(f"{self.needed_by} needs {self.label}: {self.install_hint} ({exc})") from exc
        version = importlib.metadata.version(self.module)
        major_minor = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
        if major_minor < self.oldest:
            raise MissingDependencyError(
                f"{self.needed_by} {self.requirement}; {self.module} {version} is installed: {self.install_hint}"
            )
        return module, version


__all__ = ["Framework"]
