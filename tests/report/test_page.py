"""The `routereplay demo` report folder: files written, PNGs valid, HTML complete and escaped, number formats."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib  # noqa: F401  (installed by `make test`; the report cannot be drawn without it)
import numpy as np
import pytest

from routereplay.errors import ConfigError
from routereplay.report.page import write_report
from routereplay.report.table import METRIC_ROWS, format_metric

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = ("per_layer_disagreement.png", "dlogp_hist.png", "kl.png")


def _mode_metrics(dlogp_N: np.ndarray, per_layer_L: list[float]) -> dict[str, Any]:
    ratio_N = np.exp(dlogp_N)
    return {
        "routing_disagreement": float(np.mean(per_layer_L)),
        "token_disagreement": min(1.0, 4 * float(np.mean(per_layer_L))),
        "mean_layers_differing": float(np.sum(per_layer_L)),
        "jaccard": 1.0 - float(np.mean(per_layer_L)) / 2,
        "per_layer_disagreement": per_layer_L,
        "k3_kl": float(np.mean(ratio_N - 1 - dlogp_N)),
        "mean_abs_dlogp": float(np.mean(np.abs(dlogp_N))),
        "signed_mean_dlogp": float(np.mean(dlogp_N)),
        "extreme_frac_2": float(np.mean(np.abs(dlogp_N) > math.log(2))),
        "chi2": float(np.mean((ratio_N - 1) ** 2)),
        "prob_abs_diff": 0.01,
        "pearson_prob": 0.99,
        "fallback_rows": 0,
    }


def fake_result(steps: bool = True, source: str = "cached:/home/user/.cache/routereplay/tiny") -> dict[str, Any]:
    """A realistic `routereplay demo --json` record: 4 MoE layers, 512 response tokens, off and R3."""
    rng = np.random.default_rng(0)
    num_tokens = 512
    # off: heavy-tailed mismatch (route flips), R3: only the bf16 noise; some exact zeros in both
    dlogp_off_N = rng.standard_t(2, num_tokens) * 0.03
    dlogp_off_N[rng.random(num_tokens) < 0.01] *= 40
    dlogp_r3_N = rng.normal(0, 0.004, num_tokens)
    dlogp_r3_N[:20] = 0.0
    layers_L = [0, 1, 2, 3]
    result: dict[str, Any] = {
        "config": {
            "arch": "qwen3_moe",
            "prompts": 64,
            "max_new_tokens": 8,
            "temperature": 1.0,
            "top_p": 1.0,
            "seed": 0,
            "engine_dtype": "bfloat16",
            "trainer_dtype": "float32",
        },
        "model": {
            "model_type": "qwen3_moe",
            "layers": layers_L,
            "num_experts": 8,
            "top_k": 2,
            "parameters": 400_000,
            "source": source,
        },
        "rollouts": {"sequences": 64, "response_tokens": num_tokens, "reward_mean": 0.62},
        "modes": {
            "off": _mode_metrics(dlogp_off_N, [0.05, 0.07, 0.1, 0.09]),
            "R3": _mode_metrics(dlogp_r3_N, [0.0, 0.0, 0.0, 0.0]),
        },
        "dlogp": {"off": dlogp_off_N.tolist(), "R3": dlogp_r3_N.tolist()},
        "steps": [],
    }
    if steps:
        result["steps"] = [
            {
                "step": step,
                "mode": mode,
                "k3_kl": (1.2e-3 if mode == "off" else 8e-5) * (1 + 0.1 * step),
                "routing_disagreement": 0.08 + 0.004 * step if mode == "off" else 0.0,
                "reward_mean": 0.5 + 0.02 * step,
            }
            for mode in ("off", "R3")
            for step in range(6)
        ]
    return result


def test_write_report_writes_valid_pngs_and_html(tmp_path: Path) -> None:
    start = time.perf_counter()
    paths = write_report(fake_result(), tmp_path / "report")
    elapsed = time.perf_counter() - start
    names = [path.name for path in paths]
    assert names == [*PLOTS, "steps.png", "report.html"], names
    for path in paths:
        assert path.is_file() and path.parent == tmp_path / "report", path
        data = path.read_bytes()
        if path.suffix == ".png":
            assert data.startswith(PNG_SIGNATURE), f"{path.name} is not a PNG"
            assert len(data) > 5_000, f"{path.name} is only {len(data)} bytes: an empty or broken plot"
    assert not list((tmp_path / "report").glob(".*.tmp")), "temporary files left behind"
    assert elapsed < 10, f"write_report took {elapsed:.1f}s; it must stay interactive (< 3 s on a laptop)"


def test_report_html_has_table_metrics_and_images(tmp_path: Path) -> None:
    result = fake_result()
    result["modes"]["R2"] = copy.deepcopy(result["modes"]["off"])
    paths = write_report(result, tmp_path)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert paths[-1] == tmp_path / "report.html"
    assert page.startswith("<!DOCTYPE html>")
    for mode in ("off", "R2", "R3"):
        assert f"<th>{mode}</th>" in page, f"no column for mode {mode}"
    assert "<th>R3/off</th>" in page and "<th>R2/off</th>" in page, "ratio columns missing"
    # column order off, R2, R3 whatever the record order
    assert page.index("<th>off</th>") < page.index("<th>R2</th>") < page.index("<th>R3</th>")
    present = {key for mode in result["modes"].values() for key in mode}
    for name, _, _ in METRIC_ROWS:
        if name in present:  # rows appear for the metrics the record has (update_* only after GRPO steps)
            assert f"<code>{name}</code>" in page, f"metric {name} missing from the results table"
    for image in (*PLOTS, "steps.png"):
        assert f'<img src="{image}"' in page, f"{image} not referenced"
    assert "http://" not in page and "https://" not in page and "<script" not in page, "page must be self-contained"
    assert "7.75%" in page, "routing disagreement of off should be shown as a percentage"
    assert "qwen3_moe" in page and "bfloat16" in page and "400,000" in page


def test_steps_plot_only_with_steps(tmp_path: Path) -> None:
    result = fake_result(steps=False)
    names = [path.name for path in write_report(result, tmp_path / "empty")]
    assert "steps.png" not in names and not (tmp_path / "empty" / "steps.png").exists()
    assert 'src="steps.png"' not in (tmp_path / "empty" / "report.html").read_text(encoding="utf-8")

    del result["steps"]
    names = [path.name for path in write_report(result, tmp_path / "absent")]
    assert names == [*PLOTS, "report.html"]


def test_dlogp_plot_skipped_without_raw_arrays(tmp_path: Path) -> None:
    result = fake_result(steps=False)
    del result["dlogp"]
    names = [path.name for path in write_report(result, tmp_path)]
    assert names == ["per_layer_disagreement.png", "kl.png", "report.html"]


def test_html_escapes_untrusted_strings(tmp_path: Path) -> None:
    result = fake_result(source="<script>alert('x')</script>&")
    result["modes"]['R"<b>'] = copy.deepcopy(result["modes"]["R3"])
    write_report(result, tmp_path)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "<script>" not in page and "<b>" not in page, "untrusted strings must be HTML-escaped"
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;&amp;" in page


def test_malformed_result_is_rejected(tmp_path: Path) -> None:
    result = fake_result()
    del result["modes"]
    with pytest.raises(ConfigError, match="no 'modes' entry"):
        write_report(result, tmp_path)
    result = fake_result()
    result["modes"]["off"]["per_layer_disagreement"] = [0.1, 0.2]
    with pytest.raises(ConfigError, match="2 values but model.layers lists 4"):
        write_report(result, tmp_path)


def test_global_layer_numbers_are_accepted(tmp_path: Path) -> None:
    result = fake_result(steps=False)
    result["model"]["layers"] = [1, 3, 5, 7]
    assert (tmp_path / "per_layer_disagreement.png") in write_report(result, tmp_path)


def test_import_does_not_need_matplotlib() -> None:
    code = "import sys, routereplay.report; assert 'matplotlib' not in sys.modules, 'imported matplotlib eagerly'"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr


def test_missing_matplotlib_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install 'routereplay\[demo\]'"):
        write_report(fake_result(), tmp_path)


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("routing_disagreement", 0.08, "8.00%"),
        ("routing_disagreement", 0.0, "0%"),
        ("token_disagreement", 0.3, "30.00%"),
        ("extreme_frac_2", 0.004, "0.40%"),
        ("extreme_frac_2", 1e-6, "1.0e-4%"),
        ("jaccard", 0.95, "95.00%"),
        ("k3_kl", 1.2e-3, "1.20e-3"),
        ("k3_kl", 0.0, "0"),
        ("chi2", 0.003, "3.00e-3"),
        ("chi2", 12.5, "1.25e1"),
        ("mean_abs_dlogp", 0.03, "0.03"),
        ("pearson_prob", 0.987654, "0.9877"),
        ("mean_layers_differing", 0.32, "0.32"),
        ("signed_mean_dlogp", -0.001, "-0.001"),
        ("signed_mean_dlogp", -1.2345e-5, "-1.234e-5"),
        ("fallback_rows", 0, "0"),
        ("fallback_rows", 12, "12"),
        ("prob_abs_diff", float("nan"), "n/a"),
    ],
)
def test_format_metric(name: str, value: float, expected: str) -> None:
    assert format_metric(name, value) == expected


def test_report_intro_explains_every_mode_and_the_steps_caption_every_panel() -> None:
    """report.html's intro explained off and R3 but not R2, whose column the table shows; the steps figure's caption
    named 2 of its 3 panels (k3 KL, routing) and not the routing drift."""
    import re

    from routereplay.report.page import CAPTIONS, render_html

    result = fake_result()
    result["modes"]["R2"] = copy.deepcopy(result["modes"]["off"])
    intro = re.search(r"<p>(.*?)</p>", render_html(result, ["steps.png"]), re.S)
    assert intro is not None
    for mode in ("off", "R2", "R3"):
        assert f"<strong>{mode}</strong>" in intro[1], f"the intro does not say what {mode} is"
    del result["modes"]["R2"]
    assert "R2" not in render_html(result, []), "no R2 in a record without it"
    caption = CAPTIONS["steps.png"]
    for panel in ("k3 KL", "routing disagreement", "drift"):  # plots.plot_steps' three panels
        assert panel in caption


def test_the_threshold_column_names_its_margin_and_the_page_says_what_next(tmp_path: Path) -> None:
    """Issue 38 item 20: the threshold mode's column said only `R3-threshold`, and the report ended at its figures
    with no next step; the column names its margin and a last section names the guides that put R3 into a
    trainer."""
    result = fake_result(steps=False)
    result["config"]["threshold"] = 0.01
    result["modes"]["R3-threshold"] = {**copy.deepcopy(result["modes"]["R3"]), "replace_rate": 0.002}
    write_report(result, tmp_path)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "<th>R3-threshold (margin 0.01)</th>" in page and "<th>R3-threshold/off</th>" in page
    nexts = page[page.index("<h2>Next</h2>") :]
    for guide in ("replay", "trl", "verl", "skyrl", "megatron", "engines"):
        assert f"<code>docs/{guide}.md</code>" in nexts
