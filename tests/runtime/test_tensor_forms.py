"""Every hostile form of replay's arguments is a named `RouteReplayError` before the context opens (issue 38
item 9), and the forms that hold valid values (big-endian, negative strides, other widths) replay as their
native copy, with the truth read from the model's experts modules (`tests/runtime/models.py` probes).

Legend: B = batch rows, S = positions, L = bound layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

import routereplay
from routereplay.errors import (
    ConfigError,
    DtypeError,
    ExpertIdRangeError,
    RouteReplayError,
    WeightsShapeError,
    WeightsValueError,
)
from tests.runtime.models import experts_inputs, gate_weights_probe, random_routes, tiny_qwen3

pytestmark = [pytest.mark.hf, pytest.mark.filterwarnings("ignore::UserWarning")]

B, S = 2, 6
Case = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], dict[str, Any]]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, :2] = 0  # left padding on one row
    return ids, mask


def _setup() -> tuple[routereplay.Replayer, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A replayer, routes_BSLK (-1 on padding), weights_BSLK (0 there) and the mask."""
    replayer = routereplay.attach(tiny_qwen3())
    _, mask = _batch()
    routes_BSLK = random_routes(B, S, len(replayer.layers), 2, 8, seed=11)
    routes_BSLK[~mask.bool()] = -1
    weights_BSLK = torch.full(routes_BSLK.shape, 0.375)
    weights_BSLK[~mask.bool()] = 0.0
    return replayer, routes_BSLK, weights_BSLK, mask


def _np(array: torch.Tensor, dtype: Any) -> np.ndarray:
    return array.numpy().astype(dtype)


def _negative_strides(array: np.ndarray) -> np.ndarray:
    """A view with negative strides on the last axis holding exactly `array`'s values."""
    view = np.ascontiguousarray(array[..., ::-1])[..., ::-1]
    assert view.strides[-1] < 0
    return view


def _uint64_beyond_int64(routes: torch.Tensor) -> np.ndarray:
    out = np.where(routes.numpy() < 0, 0, routes.numpy()).astype(np.uint64)
    out[0, 1, 0, :] = np.uint64(2**64 - 1)  # cast to int64: -1, a silent "no route" on a whole row
    return out


def _nested(t: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor([t[0], t[1, :3]], layout=torch.jagged)


def _quantized(t: torch.Tensor) -> torch.Tensor:
    return torch.quantize_per_tensor(t.float().clamp(min=0), 1.0, 0, torch.quint8)


def _padding_as(mask: torch.Tensor, value: float) -> torch.Tensor:
    return torch.where(mask.bool(), 1.0, value)


def _with_traces(r: torch.Tensor, m: torch.Tensor, ids: torch.Tensor) -> dict[str, Any]:
    ids_BS, _ = _batch()
    replayer = routereplay.attach(tiny_qwen3())
    with torch.no_grad(), replayer.record() as rec:
        replayer.model(input_ids=ids_BS, attention_mask=m)
    return {"routes": rec.traces(m, input_ids=ids_BS), "attention_mask": m, "input_ids": ids}


HOSTILE: list[Any] = [
    # combine weights (replay(weights=...))
    *(
        pytest.param(
            lambda r, w, m, d=dtype: {"weights": _np(w, d)},
            WeightsShapeError,
            "must be floating point",
            id=f"weights-numpy-{np.dtype(dtype).name}",
        )
        for dtype in ("?", "O", "M8[s]", "m8[s]", "c8", "c16", "u1", "u2", "u4", "u8", "i1", "i8", ">i4", "U3", "V8")
    ),
    pytest.param(
        lambda r, w, m: {"weights": w.to("meta")},
        ConfigError,
        r"weights is on the 'meta' device .* holds no values, and replay reads the values of weights: materialise",
        id="weights-meta",
    ),
    pytest.param(
        lambda r, w, m: {"weights": w.to_sparse()},
        ConfigError,
        r"weights is a torch.sparse_coo tensor .*weights.to_dense",
        id="weights-sparse",
    ),
    pytest.param(
        lambda r, w, m: {"weights": _nested(w)},
        ConfigError,
        r"weights is a nested \(jagged\) tensor",
        id="weights-nested",
    ),
    pytest.param(
        lambda r, w, m: {"weights": _quantized(w)},
        ConfigError,
        r"weights is a quantized .*weights.dequantize",
        id="weights-quantized",
    ),
    pytest.param(
        lambda r, w, m: {"weights": w.to(torch.complex64)},
        WeightsShapeError,
        "must be floating point",
        id="weights-complex-tensor",
    ),
    pytest.param(
        lambda r, w, m: {"weights": np.float32(0.5)}, WeightsShapeError, r"got float32", id="weights-numpy-scalar"
    ),
    pytest.param(
        lambda r, w, m: {"weights": np.array(0.5)}, WeightsShapeError, r"shape \(\) but the routes", id="weights-0d"
    ),
    pytest.param(
        lambda r, w, m: {"weights": np.where(_np(w, np.float64) > 0, 1e300, 0.0)},
        WeightsValueError,
        r"is not finite in float32 \(NaN, inf, or beyond float32's",
        id="weights-beyond-float32",
    ),
    pytest.param(
        lambda r, w, m: {"weights": np.where(_np(w, np.longdouble) > 0, np.longdouble("1e400"), 0)},
        WeightsValueError,
        r"is not finite in float32",
        id="weights-longdouble-beyond-float64",
    ),
    # threshold=
    *(
        pytest.param(lambda r, w, m, v=value: {"threshold": v}, ConfigError, match, id=f"threshold-{name}")
        for name, value, match in (
            ("10**400", 10**400, r"threshold=<int of 1329 bits>: give a finite margin >= 0"),
            ("-10**400", -(10**400), r"threshold=<-int of 1329 bits>"),
            ("10**5000", 10**5000, r"threshold=<int of 16610 bits>"),  # Python refuses to print it whole
            ("nan", float("nan"), r"threshold=nan: .* no finite float value"),
            ("inf", float("inf"), r"threshold=inf"),
            ("-inf", -float("inf"), r"threshold=-inf"),
            ("numpy-float32-nan", np.float32("nan"), r"threshold=np.float32\(nan\)"),
            ("longdouble-inf", np.longdouble("inf"), r"threshold=np.longdouble\('inf'\)"),
            ("negative", -0.5, r"threshold=-0.5: give a finite margin >= 0"),
            ("bool", True, r"threshold=True \(bool\)"),
            ("numpy-bool", np.bool_(True), r"threshold=np.True_ \(bool"),
            ("str", "0.1", r"threshold='0.1' \(str\)"),
            ("complex", 1 + 1j, r"\(complex\)"),
            ("tensor", torch.tensor(0.1), r"\(Tensor\): .* pass a Python float \(float\(threshold.item\(\)\)\)"),
            ("array", np.array(0.1), r"\(ndarray\)"),
        )
    ),
    # routes= (numpy and tensors)
    *(
        pytest.param(
            lambda r, w, m, d=dtype: {"routes": _np(r, d)},
            DtypeError,
            r"routes array has dtype .*; expert ids are integers",
            id=f"routes-numpy-{np.dtype(dtype).name}",
        )
        for dtype in ("?", "O", "M8[s]", "m8[s]", "f2", "g", "c8", "U3", "S3", "V8")
    ),
    pytest.param(
        lambda r, w, m: {"routes": _uint64_beyond_int64(r)},
        ExpertIdRangeError,
        r"uint64 id 18446744073709551615, beyond any expert",
        id="routes-uint64-beyond-int64",
    ),
    pytest.param(
        lambda r, w, m: {"routes": r.to("meta")}, ConfigError, r"routes is on the 'meta' device", id="routes-meta"
    ),
    pytest.param(
        lambda r, w, m: {"routes": r.to_sparse()},
        ConfigError,
        r"routes is a torch.sparse_coo tensor",
        id="routes-sparse",
    ),
    pytest.param(
        lambda r, w, m: {"routes": _quantized(r)},
        ConfigError,
        r"routes is a quantized torch.quint8",
        id="routes-quantized",
    ),
    pytest.param(
        lambda r, w, m: {"routes": _nested(r)}, ConfigError, r"routes is a nested \(jagged\) tensor", id="routes-nested"
    ),
    # attention_mask=
    pytest.param(
        lambda r, w, m: {"attention_mask": m.to_sparse()},
        ConfigError,
        r"attention_mask is a torch.sparse",
        id="mask-sparse",
    ),
    pytest.param(
        lambda r, w, m: {"attention_mask": _quantized(m)},
        ConfigError,
        r"attention_mask is a quantized",
        id="mask-quantized",
    ),
    *(
        pytest.param(
            lambda r, w, m, f=to: {"attention_mask": f(m.float())},
            ConfigError,
            rf"attention_mask is a torch.{name} tensor \(shape \(2, 6\)\)",
            id=f"mask-{name}",
        )
        for name, to in (
            ("sparse_csr", torch.Tensor.to_sparse_csr),
            ("sparse_csc", torch.Tensor.to_sparse_csc),
            ("sparse_bsr", lambda t: t.to_sparse_bsr(2)),
        )
    ),
    pytest.param(
        lambda r, w, m: {"attention_mask": m.float().to_mkldnn()},
        ConfigError,
        r"attention_mask is a torch._mkldnn tensor .*to_dense",
        id="mask-mkldnn",
        marks=pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without MKL-DNN"),
    ),
    pytest.param(
        lambda r, w, m: {"attention_mask": _padding_as(m, float("nan"))},
        ConfigError,
        r"attention_mask\[1, 0\] = nan \(2 such entries\); the attention mask is the \(B, S\) padding mask",
        id="mask-nan",
    ),
    pytest.param(
        lambda r, w, m: {"attention_mask": torch.where(m.bool(), 0.0, float("-inf"))},
        ConfigError,
        r"attention_mask\[1, 0\] = -inf .*an additive mask of 0 / -inf",
        id="mask-additive",
    ),
    pytest.param(
        lambda r, w, m: {"attention_mask": _padding_as(m, 0.5)},
        ConfigError,
        r"= 0.5 \(2 such entries\)",
        id="mask-fraction",
    ),
    pytest.param(
        lambda r, w, m: {"attention_mask": -m}, ConfigError, r"attention_mask\[0, 0\] = -1", id="mask-negative"
    ),
    *(
        pytest.param(
            lambda r, w, m, d=dtype: {"attention_mask": _np(m, d)},
            ConfigError,
            r"attention_mask has dtype",
            id=f"mask-numpy-{np.dtype(dtype).name}",
        )
        for dtype in ("O", "U3", "M8[s]", "c8")
    ),
    pytest.param(
        lambda r, w, m: {"attention_mask": m.to(torch.complex64)},
        ConfigError,
        r"attention_mask has dtype torch.complex64",
        id="mask-complex-tensor",
    ),
    pytest.param(
        lambda r, w, m: {"attention_mask": [[1, 1], [1]]},
        ConfigError,
        r"attention_mask is not a \(B, S\)",
        id="mask-ragged",
    ),
    # input_ids= (with RouteTraces carrying token ids)
    pytest.param(
        lambda r, w, m: _with_traces(r, m, _batch()[0].to(torch.complex64)),
        ConfigError,
        r"input_ids must be a \(B, S\) integer tensor, got Tensor torch.complex64",
        id="ids-complex",
    ),
    pytest.param(
        lambda r, w, m: _with_traces(r, m, _batch()[0].bool()),
        ConfigError,
        r"input_ids must be .* torch.bool",
        id="ids-bool",
    ),
    pytest.param(
        lambda r, w, m: _with_traces(r, m, _batch()[0].to_sparse()),
        ConfigError,
        r"input_ids is a torch.sparse_coo",
        id="ids-sparse",
    ),
    # flags
    pytest.param(
        lambda r, w, m: {"check_alignment": "no"},
        ConfigError,
        r"check_alignment='no': pass True",
        id="check-alignment-str",
    ),
]


@pytest.mark.parametrize(("case", "error", "match"), HOSTILE)
def test_hostile_replay_arguments_are_named_errors_before_the_context_opens(
    case: Case, error: type[RouteReplayError], match: str
) -> None:
    replayer, routes_BSLK, weights_BSLK, mask = _setup()
    kwargs: dict[str, Any] = {"routes": routes_BSLK, "attention_mask": mask, **case(routes_BSLK, weights_BSLK, mask)}
    with pytest.raises(error, match=match):
        with replayer.replay(**kwargs):
            raise AssertionError("the context must not open")
    assert replayer.mode == "off"


def _routed_everywhere(routes_BSLK: torch.Tensor) -> torch.Tensor:
    """The routes with every -1 row routed ([0, 1]): unsigned arrays hold no -1 (a fully routed row carries no
    padding layout, so it replays on any mask)."""
    out = routes_BSLK.clone()
    out[out[..., 0] < 0] = torch.tensor([0, 1])
    return out


@pytest.mark.parametrize(
    ("form", "unsigned"),
    [
        (lambda r: r.numpy().astype(">i8"), False),
        (lambda r: r.numpy().astype(">i2"), False),
        (lambda r: _negative_strides(r.numpy().astype(">i4")), False),
        (lambda r: r.numpy()[:, ::-1][:, ::-1], False),
        (lambda r: r.numpy().astype(">u2"), True),
        (lambda r: _negative_strides(r.numpy().astype(">u8")), True),
    ],
    ids=[
        "big-endian-int64",
        "big-endian-int16",
        "big-endian-negative-strides",
        "view",
        "big-endian-uint16",
        "big-endian-uint64-negative-strides",
    ],
)
def test_convertible_routes_force_exactly_their_ids(form: Callable[[torch.Tensor], np.ndarray], unsigned: bool) -> None:
    """Big-endian and negative-stride arrays are read as their values: the experts receive those ids."""
    replayer, routes_BSLK, _, mask = _setup()
    routes_BSLK = _routed_everywhere(routes_BSLK) if unsigned else routes_BSLK
    ids, _ = _batch()
    given = form(routes_BSLK)
    with torch.no_grad(), replayer.replay(given, attention_mask=mask), experts_inputs(replayer.model) as seen:
        replayer.model(input_ids=ids, attention_mask=mask)
    for column, layer in enumerate(replayer.layers):
        got_TK = seen[layer][0]
        want_TK = routes_BSLK[:, :, column].reshape(-1, 2)
        forced_T = want_TK[:, 0] >= 0
        assert forced_T.sum() >= (10 if not unsigned else B * S)
        assert [set(row) for row in got_TK[forced_T].tolist()] == [set(row) for row in want_TK[forced_T].tolist()]


@pytest.mark.parametrize(
    "form",
    [
        lambda w: w.astype(">f4"),
        lambda w: w.astype(">f8"),
        lambda w: w.astype(np.longdouble),
        lambda w: w.astype(np.float16),
        lambda w: _negative_strides(w.astype(">f8")),
        lambda w: w.copy(),
    ],
    ids=["big-endian-float32", "big-endian-float64", "longdouble", "float16", "big-endian-negative-strides", "float32"],
)
def test_convertible_weights_reach_the_experts_as_given(form: Callable[[np.ndarray], np.ndarray]) -> None:
    """Any float width, byte order or strides: the experts compute with exactly the given values (chosen
    representable in float16, so every form holds them exactly)."""
    replayer, routes_BSLK, _, mask = _setup()
    ids, _ = _batch()
    rng = np.random.default_rng(0)
    weights_BSLK = (rng.integers(1, 64, routes_BSLK.shape) / 64).astype(np.float32)
    weights_BSLK[routes_BSLK.numpy() < 0] = 0
    given = form(weights_BSLK)
    given.flags.writeable = False  # read-only too
    with torch.no_grad(), replayer.replay(routes_BSLK, mask, weights=given), gate_weights_probe(replayer.model) as seen:
        replayer.model(input_ids=ids, attention_mask=mask)
    for column, layer in enumerate(replayer.layers):
        got_ids_TK, got_TK = seen[layer][0]
        want_ids_TK = routes_BSLK[:, :, column].reshape(-1, 2)
        want_TK = weights_BSLK[:, :, column].reshape(-1, 2)
        for t in np.flatnonzero(want_ids_TK[:, 0].numpy() >= 0):
            got = dict(zip(got_ids_TK[t].tolist(), got_TK[t].tolist(), strict=True))
            assert got == dict(zip(want_ids_TK[t].tolist(), want_TK[t].tolist(), strict=True)), (layer, t)


@pytest.mark.parametrize(
    "value",
    [np.float32(0.25), np.float64(0.25), np.longdouble(0.25), Fraction(1, 4), 0.25],
    ids=["numpy-float32", "numpy-float64", "longdouble", "fraction", "float"],
)
def test_real_number_thresholds_replay_as_their_float(value: Any) -> None:
    replayer, routes_BSLK, _, mask = _setup()
    ids, _ = _batch()
    counts = []
    for margin in (0.25, value):
        replayer.stats.reset()
        with torch.no_grad(), replayer.replay(routes_BSLK, mask, threshold=margin) as used:
            replayer.model(input_ids=ids, attention_mask=mask)
        counts.append((replayer.stats.replaced_rows, used.routes.clone()))
    assert counts[0][0] == counts[1][0] and torch.equal(counts[0][1], counts[1][1])


@pytest.mark.parametrize(
    "value",
    [0, np.int64(0), -0.0, 10**20, np.uint64(2**64 - 1)],
    ids=["int-0", "numpy-int64-0", "minus-zero", "10**20", "numpy-uint64-max"],
)
def test_integer_and_huge_finite_thresholds_are_accepted(value: Any) -> None:
    """0 keeps only rows tied with the live top-k; a margin beyond every score keeps every row (plain replay)."""
    replayer, routes_BSLK, _, mask = _setup()
    ids, _ = _batch()
    with torch.no_grad(), replayer.replay(routes_BSLK, mask, threshold=value):
        replayer.model(input_ids=ids, attention_mask=mask)
    if float(value) > 1:
        assert replayer.stats.replaced_rows == 0


@pytest.mark.parametrize(
    "form",
    [
        lambda m: m.numpy().astype(">i8"),
        lambda m: _negative_strides(m.numpy().astype(">i2")),
        lambda m: m.bfloat16(),
        lambda m: m.float(),
        lambda m: m * 2,  # a packed row's segment id: non-zero = attended, as HF reads it
        lambda m: m.tolist(),
    ],
    ids=["big-endian", "negative-strides", "bfloat16", "float", "segment-ids", "list"],
)
def test_mask_forms_place_routes_like_the_bool_mask(form: Callable[[torch.Tensor], Any]) -> None:
    replayer, _, _, mask = _setup()
    ids, _ = _batch()
    with torch.no_grad(), replayer.record() as rec:
        replayer.model(input_ids=ids, attention_mask=mask)
    traces = rec.traces(mask)
    placed = []
    for given in (mask.bool(), form(mask)):
        with torch.no_grad(), replayer.replay(traces, attention_mask=given) as used:
            replayer.model(input_ids=ids, attention_mask=mask)
        placed.append(used.routes.clone())
    assert torch.equal(placed[0], placed[1])


RECORD_HOSTILE: list[Any] = [
    pytest.param(
        lambda m, ids: {"attention_mask": _padding_as(m, float("nan"))},
        ConfigError,
        r"attention_mask\[1, 0\] = nan",
        id="mask-nan",
    ),
    pytest.param(
        lambda m, ids: {"attention_mask": m.to_sparse()},
        ConfigError,
        r"attention_mask is a torch.sparse",
        id="mask-sparse",
    ),
    pytest.param(
        lambda m, ids: {"attention_mask": m.numpy().astype("U1")},
        ConfigError,
        r"attention_mask has dtype",
        id="mask-str",
    ),
    pytest.param(
        lambda m, ids: {"attention_mask": m, "input_ids": ids.float()},
        ConfigError,
        r"input_ids has dtype torch.float32; token ids are integers",
        id="ids-float",
    ),
    pytest.param(
        lambda m, ids: {"attention_mask": m, "input_ids": ids.to(torch.complex64)},
        ConfigError,
        r"input_ids has dtype torch.complex64",
        id="ids-complex",
    ),
    pytest.param(
        lambda m, ids: {"attention_mask": m, "input_ids": ids.numpy().astype(object)},
        ConfigError,
        r"input_ids has dtype object",
        id="ids-object",
    ),
    pytest.param(
        lambda m, ids: {"attention_mask": m, "input_ids": [[1, 2], [3]]},
        ConfigError,
        r"input_ids is not a \(B, S\) integer array",
        id="ids-ragged",
    ),
    pytest.param(
        lambda m, ids: {"attention_mask": m, "input_ids": ids.to_sparse()},
        ConfigError,
        r"input_ids is a torch.sparse_coo",
        id="ids-sparse",
    ),
]


@pytest.mark.parametrize(("case", "error", "match"), RECORD_HOSTILE)
def test_hostile_record_arguments_are_named_errors(case: Any, error: type[RouteReplayError], match: str) -> None:
    """`Recording.traces(mask, input_ids=)` after `record()`: the same forms as replay's, refused by name."""
    replayer, _, _, mask = _setup()
    ids, _ = _batch()
    with torch.no_grad(), replayer.record() as rec:
        replayer.model(input_ids=ids, attention_mask=mask)
    with pytest.raises(error, match=match):
        rec.traces(**case(mask, ids))


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda model: routereplay.attach(model, jitter="none"), r"jitter='none': use 'model'"),
        (lambda model: routereplay.attach(model, strict="yes"), r"strict='yes': pass True"),  # type: ignore[arg-type]
        (lambda model: routereplay.attach(model, sync_free=1), r"sync_free=1: pass None"),  # type: ignore[arg-type]
        (
            lambda model: routereplay.attach(model).record(weights="yes").__enter__(),  # type: ignore[arg-type]
            r"record\(weights='yes'\)",
        ),
    ],
    ids=["jitter", "strict", "sync-free", "record-weights"],
)
def test_hostile_attach_and_record_flags_are_config_errors(factory: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        factory(tiny_qwen3())
