"""The verl batch readers (`routes_for_batch`, `padded_routes`, `dense_routed_experts`, `routed_experts_for_batch`)
on malformed, hostile and misaligned batches: each refused by name before anything large is allocated.

No verl here: the readers take verl's containers duck-typed, so a `DataProto` is a stand-in with `batch` /
`non_tensor_batch` dicts and a jagged `TensorDict` a dict holding a nested `input_ids` (the real containers
run in test_verl_routed_experts.py and test_rollout_batch.py).

Legend: B samples, S padded positions, P prompt width, L layers, K top-k, N tokens of a sample.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.codec.blob import encode
from routereplay.errors import (
    BatchFieldError,
    BatchGeometryError,
    ConfigError,
    DenseLayerRouteError,
    RouteReplayError,
    RowCountError,
    TokenMismatchError,
    UncheckedRoutesError,
)
from routereplay.integrations.verl import (
    DIGEST_KEY,
    ROUTES_KEY,
    RouteGeometry,
    compact_routes,
    dense_routed_experts,
    padded_routes,
    put_routes,
    routed_experts_for_batch,
    routes_for_batch,
)
from routereplay.trace.route_trace import RouteTrace

E, K, LAYERS = 16, 2, (1, 2)
GEOMETRY = RouteGeometry(num_experts=E, num_layers=3, top_k=K, moe_layers=LAYERS)
P, R = 4, 4  # prompt / response widths
LENGTHS = ((3, 3), (2, 4), (3, 3))  # (prompt, response) tokens per sample: samples 0 and 2 lie alike


class FakeDataProto:
    """verl's DataProto as the readers see it: `batch` tensors, `non_tensor_batch` numpy columns, `len`."""

    def __init__(self, batch: dict[str, Any], non_tensor_batch: dict[str, Any] | None = None) -> None:
        self.batch = batch
        self.non_tensor_batch = non_tensor_batch if non_tensor_batch is not None else {}

    def __len__(self) -> int:
        return int(self.batch["input_ids"].shape[0])


def trace(n: int, seed: int, *, layers: tuple[int, ...] = LAYERS, experts: int = E, top_k: int = K) -> RouteTrace:
    """n - 1 routed rows (the last token unrouted) of distinct experts, with their n tokens' ids."""
    rng = np.random.default_rng(seed)
    experts_TLK = np.argsort(rng.random((n - 1, len(layers), experts)), -1)[..., :top_k].astype(np.int16)
    ids = rng.integers(5, 1000, size=n - 1)
    return RouteTrace(experts_TLK, experts, layers=layers, token_ids=ids)


def batch_of(traces: list[RouteTrace], lengths: tuple[tuple[int, int], ...] = LENGTHS) -> FakeDataProto:
    """verl's padded batch for the traces: prompts left padded to P, responses right padded to R."""
    ids = torch.zeros(len(lengths), P + R, dtype=torch.int64)
    mask = torch.zeros(len(lengths), P + R, dtype=torch.int64)
    generated = torch.zeros(len(lengths), R, dtype=torch.int64)
    for b, ((p, r), t) in enumerate(zip(lengths, traces, strict=True)):
        tokens = torch.from_numpy(t.token_ids).to(torch.int64)
        tokens = torch.cat([tokens, torch.tensor([3])])  # the last token, never routed
        ids[b, P - p : P + r] = tokens
        mask[b, P - p : P + r] = 1
        generated[b, :r] = 1
    tensors = {"input_ids": ids, "attention_mask": mask, "prompts": ids[:, :P], "response_mask": generated}
    return FakeDataProto(tensors)


def traces3(**kwargs: Any) -> list[RouteTrace]:
    return [trace(p + r, seed=b, **kwargs) for b, (p, r) in enumerate(LENGTHS)]


def jagged(batch: FakeDataProto) -> dict[str, Any]:
    """What `left_right_2_no_padding` makes of it: nested input_ids (and routes), the padded masks kept."""
    keep = batch.batch["attention_mask"].bool()
    out = dict(batch.batch)
    out["input_ids"] = torch.nested.as_nested_tensor(
        [row[k] for row, k in zip(batch.batch["input_ids"], keep, strict=True)], layout=torch.jagged
    )
    if "routed_experts" in batch.batch:
        out["routed_experts"] = torch.nested.as_nested_tensor(
            [row[k] for row, k in zip(batch.batch["routed_experts"], keep, strict=True)], layout=torch.jagged
        )
    out.update(batch.non_tensor_batch)
    return out


# --- 6a: a hostile compact header ---------------------------------------------------------------------------


@pytest.mark.parametrize("geometry", [GEOMETRY, None], ids=["model-geometry", "default-limits"])
def test_hostile_compact_header_is_refused_before_allocating(geometry: RouteGeometry | None) -> None:
    """A 62-byte blob with no rows and E = K = 32767 sized the padded output from its own header (64 MiB per
    sample of 1,024 positions); now the header is checked against the model (or BatchLimits) first."""
    hostile = encode(RouteTrace(np.zeros((0, 1, 32767), dtype=np.int16), 32767, layers=(1,)), mode="ordered")
    assert len(hostile) == 62
    width = 1024
    ids = torch.full((2, width), 7, dtype=torch.int64)
    batch = FakeDataProto(
        {"input_ids": ids, "attention_mask": torch.ones(2, width, dtype=torch.int64), "prompts": ids[:, :512]},
        {ROUTES_KEY: np.array([hostile, hostile], dtype=object)},
    )
    tracemalloc.start()
    try:
        with pytest.raises(BatchGeometryError, match="sample 0: routes of .*(another model|max_route_columns)"):
            routes_for_batch(batch, geometry=geometry)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes traced: the header sized an allocation before it was checked"


def test_hostile_trace_is_refused_by_padded_routes_before_allocating() -> None:
    hostile = RouteTrace(np.zeros((0, 1, 32767), dtype=np.int16), 32767, layers=(1,))
    tracemalloc.start()
    try:
        with pytest.raises(BatchGeometryError, match="max_route_columns=4096"):
            padded_routes(hostile, prompt_len=1, response_len=1, prompt_length=1024, response_length=1024)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


# --- 6b: samples compared with each other and the model -----------------------------------------------------

DISAGREEING = {
    "layer-numbers": {"layers": (1, 3)},
    "experts": {"experts": 32},
    "top-k": {"top_k": 3},
    "layer-count": {"layers": (1,)},
}


@pytest.mark.parametrize("other", list(DISAGREEING.values()), ids=list(DISAGREEING))
@pytest.mark.parametrize("layout", ["padded", "jagged"])
def test_samples_of_one_batch_must_share_one_geometry(other: dict[str, Any], layout: str) -> None:
    """Other layer numbers or E stacked silently, other K or L raised torch's RuntimeError, and the jagged path
    returned a tensor ragged on the layer axis: each now names the sample that differs."""
    traces = traces3()
    traces[1] = trace(sum(LENGTHS[1]), seed=9, **other)
    batch = batch_of(traces)
    batch.non_tensor_batch[ROUTES_KEY] = compact_routes(traces)
    target = batch if layout == "padded" else jagged(batch)
    with pytest.raises(BatchGeometryError, match="sample 1: routes of .* but sample 0 has layers"):
        routes_for_batch(target)
    with pytest.raises(BatchGeometryError, match="sample 1: routes of .*another model"):
        routes_for_batch(target, geometry=GEOMETRY)
    with pytest.raises(BatchGeometryError, match="sample 1"):
        dense_routed_experts(traces, batch.batch["attention_mask"], P)


def test_samples_agreeing_with_the_model_read_back() -> None:
    traces = traces3()
    batch = batch_of(traces)
    batch.non_tensor_batch[ROUTES_KEY] = compact_routes(traces)
    routes_BSLK = routes_for_batch(batch, geometry=GEOMETRY)
    assert routes_BSLK.shape == (3, P + R, 2, K)
    for b, ((p, _), t) in enumerate(zip(LENGTHS, traces, strict=True)):
        got = np.sort(routes_BSLK[b, P - p : P - p + t.num_tokens].numpy(), -1)
        assert np.array_equal(got, np.sort(t.experts, -1))


# --- 6c: malformed fields -----------------------------------------------------------------------------------


def _good() -> FakeDataProto:
    traces = traces3()
    batch = batch_of(traces)
    batch.non_tensor_batch[ROUTES_KEY] = compact_routes(traces)
    return batch


def _with(key: str, value: Callable[[Any], Any]) -> Callable[[], Any]:
    def read() -> Any:
        batch = _good()
        if key == ROUTES_KEY:
            batch.non_tensor_batch[key] = value(batch.non_tensor_batch[key])
        elif value is _drop:
            del batch.batch[key]
        else:
            batch.batch[key] = value(batch.batch[key])
        return routes_for_batch(batch)

    return read


def _drop(x: Any) -> Any:
    return x


def _nan(mask: torch.Tensor) -> torch.Tensor:
    out = mask.to(torch.float32)
    out[1, 5] = float("nan")
    return out


HALF: Any = 2.5  # the values of the wrong type, typed Any so the calls below type-check
TWO: Any = 2.0
NUMPY_ROW: Any = np.zeros(4, dtype=np.int64)

MALFORMED: dict[str, tuple[Callable[[], Any], type[RouteReplayError], str]] = {
    "column-is-a-string": (_with(ROUTES_KEY, lambda c: "blobs"), BatchFieldError, "column is a str"),
    "column-is-a-tensor": (_with(ROUTES_KEY, lambda c: torch.zeros(3)), BatchFieldError, "column is a Tensor"),
    "column-holds-str": (_with(ROUTES_KEY, lambda c: np.array(["a", "b", "c"], dtype=object)), BatchFieldError,
                         "sample 0 holds a str"),
    "column-too-short": (_with(ROUTES_KEY, lambda c: c[:2]), BatchFieldError, "2 blobs for a batch of 3"),
    "no-input-ids": (_with("input_ids", _drop), BatchFieldError, "no 'input_ids' field"),
    "no-attention-mask": (_with("attention_mask", _drop), BatchFieldError, "no 'attention_mask' field"),
    "no-prompts": (_with("prompts", _drop), BatchFieldError, "no 'prompts' field"),
    "1-d-prompts": (_with("prompts", lambda x: x[0]), BatchFieldError, r"prompts is a Tensor of shape \(4,\)"),
    "narrower-input-ids": (_with("input_ids", lambda x: x[:, :-1]), BatchFieldError, "attention_mask has shape"),
    "nan-mask": (_with("attention_mask", _nan), BatchFieldError, "sample 1: attention_mask holds NaN"),
    "mask-of-2s": (_with("attention_mask", lambda m: m * 2), BatchFieldError, "attention_mask holds 2"),
    "mask-with-a-gap": (_with("attention_mask", lambda m: m.index_put((torch.tensor([2]), torch.tensor([5])),
                                                                      torch.tensor(0))),
                        BatchFieldError, "sample 2: attention_mask .* is not verl's layout"),
    "numpy-mask": (_with("attention_mask", lambda m: m.numpy()), BatchFieldError, "attention_mask is a ndarray"),
    "numpy-input-ids": (_with("input_ids", lambda x: x.numpy()), BatchFieldError, "input_ids is a ndarray"),
    "float-input-ids": (_with("input_ids", lambda x: x.float()), BatchFieldError, "input_ids has dtype"),
    "half-layers": (lambda: routes_for_batch(_good(), num_hidden_layers=HALF), ConfigError,
                    r"num_hidden_layers=2\.5 must be an int"),
    "not-a-batch": (lambda: routes_for_batch([1, 2]), BatchFieldError, "takes verl's DataProto or TensorDict"),
    "numpy-row": (lambda: padded_routes(trace(4, 0), prompt_len=2, response_len=2, prompt_length=2,
                                        response_length=2, input_ids_S=NUMPY_ROW),
                  BatchFieldError, "input_ids_S is a ndarray"),
    "float-length": (lambda: padded_routes(trace(4, 0), prompt_len=TWO, response_len=2, prompt_length=2,
                                           response_length=2), ConfigError, r"prompt_len=2\.0 must be an int"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_fields_raise_named_errors(case: tuple[Callable[[], Any], type[RouteReplayError], str]) -> None:
    """Each raised a bare TypeError / KeyError / IndexError / ValueError (or read past the mask) before."""
    read, error, match = case
    with pytest.raises(error, match=match) as raised:
        read()
    assert isinstance(raised.value, RouteReplayError)


# --- 6d and 4: the dense form read back ---------------------------------------------------------------------


def _dense() -> FakeDataProto:
    traces = traces3()
    batch = batch_of(traces)
    put_routes(batch, traces, form="dense", num_hidden_layers=3)
    return batch


def test_dense_form_reads_back_exactly_with_its_digest() -> None:
    batch = _dense()
    assert DIGEST_KEY in batch.non_tensor_batch
    want = batch.batch["routed_experts"]
    assert torch.equal(routed_experts_for_batch(batch, geometry=GEOMETRY), want)
    assert torch.equal(routed_experts_for_batch(jagged(batch)).values(), want[batch.batch["attention_mask"].bool()])


def _shift(routes: torch.Tensor) -> torch.Tensor:
    return torch.roll(routes, 1, dims=1)


def _drop_middle_row(routes: torch.Tensor) -> torch.Tensor:
    out = routes.clone()
    out[0, 4:-1] = routes[0, 5:].clone()  # sample 0's row at position 4 dropped, the rest moved up
    out[0, -1] = -1
    return out


def _swap_equal_length(routes: torch.Tensor) -> torch.Tensor:
    return routes[[2, 1, 0]]  # samples 0 and 2 both hold 6 tokens


@pytest.mark.parametrize("move", [_shift, _drop_middle_row, _swap_equal_length], ids=["shift", "drop-row", "swap"])
@pytest.mark.parametrize("layout", ["padded", "jagged"])
def test_dense_routes_moved_apart_from_their_tokens_are_refused(
    move: Callable[[torch.Tensor], Any], layout: str
) -> None:
    """Shifted by one position, a middle row dropped, or equal-length samples swapped: each replayed silently."""
    batch = _dense()
    batch.batch["routed_experts"] = move(batch.batch["routed_experts"])
    with pytest.raises(TokenMismatchError, match="sample [02]: its routed_experts rows and input_ids"):
        routed_experts_for_batch(batch if layout == "padded" else jagged(batch))


def test_jagged_routes_with_a_row_dropped_are_refused() -> None:
    batch = _dense()
    target = jagged(batch)
    parts = list(target["routed_experts"].unbind())
    parts[1] = torch.cat([parts[1][:2], parts[1][3:]])
    target["routed_experts"] = torch.nested.as_nested_tensor(parts, layout=torch.jagged)
    with pytest.raises(RowCountError, match="sample 1: routed_experts holds 5 rows for 6 tokens"):
        routed_experts_for_batch(target)


def test_dense_routes_without_a_digest_are_refused_unless_unchecked() -> None:
    batch = _dense()
    del batch.non_tensor_batch[DIGEST_KEY]
    with pytest.raises(UncheckedRoutesError, match="no 'routereplay_routes_digest' column.*unchecked=True"):
        routed_experts_for_batch(batch)
    assert torch.equal(routed_experts_for_batch(batch, unchecked=True, recorded=True), batch.batch["routed_experts"])


def test_expert_ids_in_a_dense_layers_column_are_refused() -> None:
    """The all-layer payload's column of dense layer 0 must hold nothing (0 or -1); ids there were dropped."""
    batch = _dense()
    del batch.non_tensor_batch[DIGEST_KEY]  # the digest would refuse the edit first
    routes = batch.batch["routed_experts"].clone()
    routes[1, 5, 0] = torch.tensor([3, 7])
    batch.batch["routed_experts"] = routes
    with pytest.raises(DenseLayerRouteError, match="sample 1, token 3: dense layer 0 .*holds expert ids"):
        routed_experts_for_batch(batch, geometry=GEOMETRY, unchecked=True, recorded=True)
    routes[1, 5, 0] = 0  # verl's own zero fill there is no route
    assert (routed_experts_for_batch(batch, geometry=GEOMETRY, unchecked=True, recorded=True)[..., 0, :] == -1).all()


# --- 5: verl's zero-filled form --------------------------------------------------------------------------


def _verl_tool_sample(top_k: int) -> tuple[FakeDataProto, torch.Tensor]:
    """One multi-turn sample in verl's layout (P = 4, R = 10): a 3-token prompt, 2 generated tokens, 2 tool
    tokens, 2 generated, 2 tool tokens after the last call. The last call's 8 rows (its 9 tokens but the last)
    sit at [1, 9), zeros elsewhere, as `_agent_loop_postprocess` fills them; rows 2 and 5 (a prompt token and a
    tool token the last call prefilled) genuinely route to expert 0 in every layer."""
    prompt_width, width = 4, 14
    generator = torch.Generator().manual_seed(top_k)
    rows_TLK = torch.stack([torch.randperm(8, generator=generator)[:top_k] + 1 for _ in range(8 * 2)])
    rows_TLK = rows_TLK.reshape(8, 2, top_k)
    rows_TLK[[2, 5], :, 0] = 0
    routes = torch.zeros(1, width, 2, top_k, dtype=torch.int16)
    routes[0, 1:9] = rows_TLK
    ids = torch.arange(width, dtype=torch.int64)[None] + 10
    mask = torch.tensor([[0] + [1] * 11 + [0] * 2])
    generated = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0, 0, 0]])
    tensors = {
        "input_ids": ids,
        "attention_mask": mask,
        "prompts": ids[:, :prompt_width],
        "response_mask": generated,
        "routed_experts": routes,
    }
    return FakeDataProto(tensors), routes


def test_verl_zero_rows_of_a_top1_model_are_no_route_where_verls_masks_say_so() -> None:
    """Top-1: a zero row is a valid route, so only verl's masks tell padding (attention_mask 0), the last
    generated token and the tool tokens after the last call (from the last response_mask 1 on) from expert 0."""
    batch, routes = _verl_tool_sample(top_k=1)
    geometry = RouteGeometry(num_experts=16, num_layers=2, top_k=1, moe_layers=(0, 1))
    got = routed_experts_for_batch(batch, geometry=geometry, unchecked=True)
    unrouted = [0, 9, 10, 11, 12, 13]
    assert (got[0, unrouted] == -1).all()
    routed = [s for s in range(14) if s not in unrouted]
    assert torch.equal(got[0, routed], routes[0, routed])
    assert (got[0, [3, 6]] == 0).all()  # the genuine expert-0 routes stay
    assert torch.equal(
        routed_experts_for_batch(jagged(batch), geometry=geometry, unchecked=True).values(), got[0, 1:12]
    )


def test_verl_zero_rows_of_a_top2_model_are_no_route_anywhere() -> None:
    batch, routes = _verl_tool_sample(top_k=2)
    got = routed_experts_for_batch(batch, unchecked=True)
    zero_rows = (routes == 0).all(-1)
    assert (got[zero_rows] == -1).all() and torch.equal(got[~zero_rows], routes[~zero_rows])
    assert (got[0, [0, 9, 10, 11, 12, 13]] == -1).all()


def test_r2_recorded_zero_rows_stay_expert_0() -> None:
    batch, routes = _verl_tool_sample(top_k=1)
    assert torch.equal(routed_experts_for_batch(batch, unchecked=True, recorded=True), routes)


# --- issue 38 item 5: verl's response_mask must be 0/1 --------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), 0.5, -1.0], ids=["nan", "half", "minus-one"])
def test_a_response_mask_that_is_not_0_1_is_refused_before_zero_rows_become_expert_0(value: float) -> None:
    """verl's zero rows become -1 from each sample's last generated token (its last response_mask 1) on. A NaN,
    0.5 or -1 on the trailing tool tokens counted as "generated", so on a top-1 model their zero rows stayed
    expert 0 and replayed; now the mask is refused by name before the routes are copied."""
    batch, _ = _verl_tool_sample(top_k=1)
    geometry = RouteGeometry(num_experts=16, num_layers=2, top_k=1, moe_layers=(0, 1))
    mask = batch.batch["response_mask"].to(torch.float32)
    mask[0, 6:8] = value  # the two tool tokens after the last call
    batch.batch["response_mask"] = mask
    with pytest.raises(BatchFieldError, match=r"sample 0, response position 6: response_mask holds"):
        routed_experts_for_batch(batch, geometry=geometry, unchecked=True)
    with pytest.raises(BatchFieldError, match=r"sample 0, response position 6: response_mask holds"):
        routed_experts_for_batch(jagged(batch), geometry=geometry, unchecked=True)
    batch.batch["response_mask"] = (mask == 1).to(torch.float32)  # a float 0/1 mask is verl's too: read back
    assert (routed_experts_for_batch(batch, geometry=geometry, unchecked=True)[0, 9:12] == -1).all()


# --- issue 38 item 9: route tensors and digest columns torch cannot read -------------------------------------


def _routes_as(convert: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], Any]:
    def read() -> Any:
        batch, routes = _verl_tool_sample(top_k=1)
        batch.batch["routed_experts"] = convert(routes)
        return routed_experts_for_batch(batch, geometry=GEOMETRY_TOP1, unchecked=True)

    return read


def _digest_column(column: Any, layout: str) -> Callable[[], Any]:
    def read() -> Any:
        batch = _dense()
        batch.non_tensor_batch[DIGEST_KEY] = column
        return routed_experts_for_batch(batch if layout == "padded" else jagged(batch), geometry=GEOMETRY)

    return read


GEOMETRY_TOP1 = RouteGeometry(num_experts=16, num_layers=2, top_k=1, moe_layers=(0, 1))
UNREADABLE: dict[str, tuple[Callable[[], Any], str]] = {
    "uint16": (_routes_as(lambda r: r.to(torch.uint16)), "dtype torch.uint16"),
    "uint32": (_routes_as(lambda r: r.to(torch.uint32)), "dtype torch.uint32"),
    "uint64": (_routes_as(lambda r: r.to(torch.uint64)), "dtype torch.uint64"),
    "meta": (_routes_as(lambda r: r.to("meta")), "routed_experts is on the meta device"),
    "sparse-coo": (_routes_as(lambda r: r.to_sparse()), "routed_experts has layout torch.sparse_coo"),
    "digests-5": (_digest_column(5, "padded"), r"column is a int \(no sequence\) for 3 samples"),
    "digests-5-jagged": (_digest_column(5, "jagged"), r"column is a int \(no sequence\) for 3 samples"),
    "digests-0-d-tensor": (_digest_column(torch.tensor(5), "jagged"), r"column is a Tensor \(shape \(\)\)"),
    "digests-0-d-array": (_digest_column(np.array(5, dtype=object), "padded"), r"column is a ndarray \(shape \(\)\)"),
    "digests-of-ints": (_digest_column([5, 5, 5], "padded"), "sample 0 holds a int, not a 16-byte digest"),
}


@pytest.mark.parametrize("case", list(UNREADABLE.values()), ids=list(UNREADABLE))
def test_route_tensors_and_digest_columns_torch_cannot_read_raise_named_errors(
    case: tuple[Callable[[], Any], str],
) -> None:
    """Each raised torch's NotImplementedError / RuntimeError / TypeError (or, for a column of ints, a misleading
    TokenMismatchError) from inside the reader; now a `BatchFieldError` that names the field and the fix."""
    read, match = case
    with pytest.raises(BatchFieldError, match=match):
        read()


def test_uint8_routes_read_back_as_int16_with_minus_one_for_no_route() -> None:
    """vLLM >= 0.26 hands uint8 routes, which cannot hold -1: the reader widens them to int16. Before, the model's
    geometry refused every uint8 entry as out of range (-1 wrapped to 255 in the comparison), and without it the
    rows verl's masks say no engine routed came back as 255, an expert id."""
    batch, routes = _verl_tool_sample(top_k=1)
    want = routed_experts_for_batch(batch, geometry=GEOMETRY_TOP1, unchecked=True)
    batch.batch["routed_experts"] = routes.to(torch.uint8)
    for geometry in (GEOMETRY_TOP1, None):
        got = routed_experts_for_batch(batch, geometry=geometry, unchecked=True)
        assert got.dtype == torch.int16 and torch.equal(got, want)
        assert (got[0, [0, 9, 10, 11, 12, 13]] == -1).all()
