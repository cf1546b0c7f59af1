"""The public names: the package root's `__all__` stays as it was, every folder's face exports objects
that are the ones its files define, and pickles of attached models keep loading.
"""

from __future__ import annotations

import importlib
import pickle

import pytest
import torch

import routereplay

# routereplay.__all__ as it stood before the layout moved into folders: moving files renames no public name
ROOT_NAMES = [
    "CodecMode",
    "IndexerTrace",
    "MergePolicy",
    "Recording",
    "ReplayMode",
    "ReplayOrder",
    "ReplayStats",
    "Replayer",
    "RouteReplayError",
    "RouteStore",
    "RouteTrace",
    "Segment",
    "Source",
    "__version__",
    "attach",
    "attach_megatron",
    "decode",
    "decode_megatron",
    "decode_sglang",
    "decode_sglang_indexer",
    "decode_vllm",
    "encode",
]
FACES = ("trace", "codec", "store", "tracefile", "transport", "indexer", "wire", "layout", "runtime", "report")


def test_root_names_are_unchanged() -> None:
    assert routereplay.__all__ == ROOT_NAMES
    assert all(hasattr(routereplay, name) for name in ROOT_NAMES)


@pytest.mark.parametrize("face", FACES)
def test_each_face_exports_the_objects_its_files_define(face: str) -> None:
    """Guards against a face that names something it does not have, or a second copy of a class (two
    `RouteTrace` classes would make isinstance checks and pickles disagree between import paths)."""
    package = importlib.import_module(f"routereplay.{face}")
    assert package.__all__, f"routereplay.{face} exports nothing"
    for name in package.__all__:
        obj = getattr(package, name)
        home = getattr(obj, "__module__", None)
        if isinstance(obj, type) or callable(obj):
            assert home is not None and home.startswith("routereplay."), (face, name, home)
            assert getattr(importlib.import_module(home), name, obj) is obj, f"{face}.{name} is a copy"


def test_root_objects_are_the_folders_objects() -> None:
    from routereplay import codec, store, trace, wire

    assert routereplay.RouteTrace is trace.RouteTrace and routereplay.Segment is trace.Segment
    assert routereplay.encode is codec.encode and routereplay.decode is codec.decode
    assert routereplay.RouteStore is store.RouteStore
    assert (
        routereplay.decode_vllm is wire.decode_vllm and routereplay.decode_sglang_indexer is wire.decode_sglang_indexer
    )


@pytest.mark.hf
def test_a_pickle_naming_the_replayer_module_for_the_model_hook_still_loads() -> None:
    """Attached models pickled while the model's pre-hook lived in `runtime/replayer.py` name
    `routereplay.runtime.replayer._ModelCallHook`; that one alias keeps them loading, as an inert hook."""
    from routereplay.runtime import attach
    from routereplay.testing import tiny_model

    model = tiny_model("qwen3_moe")
    replayer = attach(model)
    current = pickle.dumps(model, protocol=0)
    assert b"routereplay.runtime.attachment\n_ModelCallHook" in current
    old = current.replace(
        b"routereplay.runtime.attachment\n_ModelCallHook", b"routereplay.runtime.replayer\n_ModelCallHook"
    )
    assert old != current
    loaded = pickle.loads(old)
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert routereplay.runtime.attachment.attached_replayer(loaded) is None
    replayer.detach()
