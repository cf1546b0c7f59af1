"""Output paths as a new user met them (issue 22 items 9, 10, 12, 15): checked before the work, never replacing
what is not a regular file, written whole, and `-` refused by name."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from routereplay import RouteTrace, decode, encode
from routereplay.atomicfile import atomic_write
from routereplay.cli.main import EXIT_ERROR, EXIT_OK, main
from routereplay.cli.outputs import check_output_file, check_output_folder, staged_folder
from routereplay.errors import ConfigError, OrderLostError, OutputPathError
from tests.wire.payloads import distinct_routes

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture
def rrt(tmp_path: Path, rng: np.random.Generator) -> Path:
    """An ORDERED codec file: rows keep their top-k order."""
    path = tmp_path / "in.rrt"
    path.write_bytes(encode(RouteTrace(distinct_routes(rng, 6, 3, 4, 16), 16), mode="ordered"))
    return path


# -- item 9: symlinks, FIFOs, device nodes ---------------------------------------------------------------


def test_convert_refuses_a_fifo_and_leaves_it_a_fifo(
    rrt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`convert IN FIFO` renamed a regular file over the FIFO; it is refused by name, exit 2, the FIFO kept."""
    fifo = tmp_path / "pipe.rrt"
    os.mkfifo(fifo)
    assert main(["convert", str(rrt), str(fifo), "--force"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "OutputPathError" in err and "is a FIFO" in err and str(fifo) in err
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_atomic_write_refuses_a_device_node(tmp_path: Path) -> None:
    """As root, `convert ... /dev/full` replaced the device with a regular file. A device node made here (a copy
    of /dev/null's numbers, inside tmp_path) is refused and stays a device."""
    device = tmp_path / "null"
    os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    with pytest.raises(OutputPathError, match="is a character device, not a regular file"):
        atomic_write(device, b"data")
    assert stat.S_ISCHR(device.lstat().st_mode)


def test_convert_writes_through_a_symlink(rrt: Path, tmp_path: Path) -> None:
    """`convert IN LINK` replaced the symlink with a regular file; the file it points to is replaced, the link kept."""
    real = tmp_path / "runs" / "5.rrt"
    real.parent.mkdir()
    real.write_bytes(b"old")
    link = tmp_path / "latest.rrt"
    link.symlink_to(real)
    assert main(["convert", str(rrt), str(link), "--force"]) == EXIT_OK
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_bytes() == rrt.read_bytes()
    dangling = tmp_path / "next.rrt"
    dangling.symlink_to(tmp_path / "runs" / "6.rrt")
    assert main(["convert", str(rrt), str(dangling)]) == EXIT_OK
    assert dangling.is_symlink() and (tmp_path / "runs" / "6.rrt").read_bytes() == rrt.read_bytes()


# -- item 10: the codec mode of an ordered input ---------------------------------------------------------


def test_convert_keeps_an_ordered_files_mode(rrt: Path, tmp_path: Path) -> None:
    """`convert a.rrt b.rrt` re-encoded an ordered file in set mode (order lost, OrderLostError at replay)."""
    out = tmp_path / "out.rrt"
    assert main(["convert", str(rrt), str(out)]) == EXIT_OK
    again = decode(out.read_bytes())
    assert again.ordered and again == decode(rrt.read_bytes())
    assert main(["convert", str(rrt), str(tmp_path / "set.rrt"), "--mode", "set"]) == EXIT_OK  # asked: set
    assert not decode((tmp_path / "set.rrt").read_bytes()).ordered


def test_convert_refuses_ordered_mode_on_a_set_file(tmp_path: Path, rng: np.random.Generator) -> None:
    """A set-mode file has no order to keep: `--mode ordered` would claim one, so it is refused by name."""
    path = tmp_path / "set.rrt"
    path.write_bytes(encode(RouteTrace(distinct_routes(rng, 6, 3, 4, 16), 16), mode="set"))
    args = ["convert", str(path), str(tmp_path / "o.rrt"), "--mode", "ordered"]
    from routereplay.cli.main import build_parser

    parsed = build_parser().parse_args(args)
    with pytest.raises(OrderLostError, match="keeps only each row's expert set"):
        parsed.func(parsed)
    assert not (tmp_path / "o.rrt").exists()


# -- item 15: `-`, a read-only folder ----------------------------------------------------------------------


def test_dash_as_an_output_is_refused_by_name(
    rrt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`convert IN -` wrote a file named `-`; it is refused, naming stdout and the ./- spelling."""
    monkeypatch.chdir(tmp_path)
    assert main(["convert", str(rrt), "-", "--to", "rrt"]) == EXIT_ERROR
    assert "OutputPathError: OUT -: " in capsys.readouterr().err and not (tmp_path / "-").exists()
    assert main(["convert", str(rrt), "./-", "--to", "rrt"]) == EXIT_OK and (tmp_path / "-").is_file()
    for check in (check_output_file, check_output_folder):
        with pytest.raises(OutputPathError, match="not to stdout"):
            check("--report", "-")


def test_an_unwritable_folder_names_the_output_not_the_temporary(
    rrt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A read-only folder's error named `.out.rrt.<host>.<pid>.<hex>.tmp`; it names out.rrt and the folder.
    (Tests run as root, which ignores permission bits: the folder's refusal is made by os.open.)"""
    real_open = os.open

    def read_only(path: str | os.PathLike[str], flags: int, mode: int = 0o777, **kwargs: object) -> int:
        if str(path).endswith(".tmp"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, mode, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", read_only)
    out = tmp_path / "out.rrt"
    assert main(["convert", str(rrt), str(out)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out}: Permission denied (cannot create a file in {tmp_path})" in err
    assert ".tmp" not in err


# -- item 15: the report folder, written whole -------------------------------------------------------------


def test_staged_folder_interrupted_leaves_nothing(tmp_path: Path) -> None:
    """Ctrl-C while the report is written left an empty (or half) report folder; now nothing is left."""
    report = tmp_path / "report"
    with pytest.raises(KeyboardInterrupt), staged_folder(report) as staging:
        (staging / "kl.png").write_bytes(b"png")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_staged_folder_lands_whole_and_keeps_other_files(tmp_path: Path) -> None:
    report = tmp_path / "report"
    with staged_folder(report) as staging:
        (staging / "report.html").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["report"] and (report / "report.html").read_text() == "new"
    (report / "notes.txt").write_text("mine")
    with pytest.raises(OutputPathError, match="not empty; pass --force"):
        check_output_folder("--report", report, force=False)
    check_output_folder("--report", report, force=True)
    with staged_folder(report) as staging:
        (staging / "report.html").write_text("newer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]
    assert (report / "report.html").read_text() == "newer" and (report / "notes.txt").read_text() == "mine"


@pytest.mark.hf
def test_demo_refuses_a_non_empty_report_folder_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`demo --report DIR` overwrote DIR's report without --force; an existing non-empty DIR is refused first."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("ROUTEREPLAY_CACHE", str(cache))
    report = tmp_path / "report"
    report.mkdir()
    (report / "report.html").write_text("last week's run")
    args = ["demo", "--prompts", "4", "--train-steps", "2", "--max-new-tokens", "2", "--rl-steps", "0"]
    assert main([*args, "--report", str(report)]) == EXIT_ERROR
    assert f"--report {report} is a folder that is not empty; pass --force" in capsys.readouterr().err
    assert not cache.exists() and (report / "report.html").read_text() == "last week's run"


# -- item 12: outputs checked before the work ----------------------------------------------------------------


@pytest.mark.hf
@pytest.mark.parametrize("flag", ["--log", "--plot"])
def test_train_outputs_are_checked_before_training(
    flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`train --plot/--log PATH` under a file failed after every step (no table printed); now before any work."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("ROUTEREPLAY_CACHE", str(cache))
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    args = ["train", "--steps", "1", "--train-steps", "2", flag, str(blocker / "out")]
    assert main(args) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{blocker / 'out'}: Not a directory" in err
    assert not cache.exists()
    assert main(["train", "--steps", "1", flag, str(tmp_path)]) == EXIT_ERROR
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.hf
def test_an_unwritable_model_cache_fails_before_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unwritable ROUTEREPLAY_CACHE failed after the demo model trained; it fails before the first step."""
    from routereplay.rl.model import load_or_train

    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    monkeypatch.setenv("ROUTEREPLAY_CACHE", str(blocker / "cache"))
    steps: list[int] = []
    with pytest.raises(ConfigError, match="cannot be written .*set ROUTEREPLAY_CACHE to a writable folder"):
        load_or_train(steps=2, progress=lambda step, _steps, _loss: steps.append(step))
    assert steps == [], "the model trained before the cache was checked"


# -- item 15: start-up --------------------------------------------------------------------------------------

HELP_IMPORTS = """
import sys
from routereplay.cli.main import main
for argv in (["--help"], *([name, "--help"] for name in sys.argv[1:])):
    try:
        main(argv)
    except SystemExit:
        pass
heavy = sorted(name for name in ("torch", "transformers", "matplotlib", "rich", "vllm") if name in sys.modules)
print("heavy:", ",".join(heavy))
"""


def test_help_imports_no_torch() -> None:
    """`routereplay --help` took 3-4 s importing torch through the package root; no command's --help imports
    torch, transformers, matplotlib, rich or vllm (they are imported inside the commands)."""
    commands = ["demo", "train", "inspect", "convert", "bench", "env"]
    result = subprocess.run(
        [sys.executable, "-c", HELP_IMPORTS, *commands],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    assert result.stdout.strip().splitlines()[-1] == "heavy:", result.stdout[-500:]


# -- issue 30 items 15 and 21: a missing folder, `--report -`, the --log file ----------------------------------------


def test_an_output_files_missing_folder_is_refused_not_created(
    rrt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`convert m.rrt /nonexistent-dir/x.rrt` created the missing folders (even under /); refused as cp does."""
    out = tmp_path / "missing" / "deeper" / "x.rrt"
    assert main(["convert", str(rrt), str(out)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"the folder {out.parent} does not exist" in err and "mkdir -p" in err
    assert not (tmp_path / "missing").exists()
    for appends in (False, True):  # train --log / --plot, bench --output: the same rule
        with pytest.raises(OutputPathError, match="does not exist"):
            check_output_file("--log", tmp_path / "missing" / "log.jsonl", appends=appends)
    assert not (tmp_path / "missing").exists()


def test_dash_as_a_report_folder_says_folder(capsys: pytest.CaptureFixture[str]) -> None:
    """`demo --report -` said "name a file" for what is a folder."""
    with pytest.raises(OutputPathError, match=r"to a folder, not to stdout .*name a folder, or ./- for a folder"):
        check_output_folder("--report", "-")


def test_a_directory_as_the_log_is_refused_as_an_append_target(tmp_path: Path) -> None:
    """`train --log DIR` said an output "is written beside it and renamed over it", though --log appends."""
    with pytest.raises(OutputPathError, match=r"--log .* is a directory; --log appends to a file: name a file"):
        check_output_file("--log", tmp_path, appends=True)


@pytest.mark.hf
def test_train_log_starts_each_run_with_a_run_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`train --log F` appended each run's steps to F with nothing between runs; a run record now starts each run,
    and earlier lines are kept (the file is appended to, as its help says)."""
    monkeypatch.setenv("ROUTEREPLAY_CACHE", str(tmp_path / "cache"))
    log = tmp_path / "log.jsonl"
    log.write_text('{"earlier": true}\n')
    args = ["train", "--steps", "1", "--train-steps", "2", "--prompts-per-step", "2", "--group-size", "2"]
    assert main([*args, "--mini-steps", "1", "--mode", "R3", "--log", str(log), "--json"]) == EXIT_OK
    capsys.readouterr()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[0] == {"earlier": True} and [set(r) & {"run", "step"} for r in records[1:]] == [{"run"}, {"step"}]
    run = records[1]["run"]
    assert run["options"]["mode"] == "R3" and run["options"]["steps"] == 1 and run["started"].endswith("+00:00")


# -- issue 38 item 13: a report folder's missing parents --------------------------------------------------------


def test_a_report_folders_missing_parent_is_refused_not_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`demo --report /nonexist/a/b` created /nonexist/a at the end of the demo, where every other output refuses
    a missing folder; it is refused before the demo runs (a probe in place of `run_demo` would say it ran)."""
    import routereplay.rl.demo

    def ran(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the demo ran before its --report was refused")

    monkeypatch.setattr(routereplay.rl.demo, "run_demo", ran)
    report = tmp_path / "missing" / "a" / "b"
    assert main(["demo", "--report", str(report)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--report {report}: its parent folder {report.parent} does not exist" in err
    assert f"mkdir -p {report.parent}" in err and not (tmp_path / "missing").exists()
    with pytest.raises(OutputPathError, match="its parent folder .* does not exist"):
        check_output_folder("--tensorboard", tmp_path / "runs" / "exp1")
    assert check_output_folder("--report", tmp_path / "new") == tmp_path / "new"  # the folder itself is created
    assert not (tmp_path / "new").exists() and not (tmp_path / "runs").exists()
