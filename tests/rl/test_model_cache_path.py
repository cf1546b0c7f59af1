"""`load_or_train` on an empty cache returns the model it saved, pointing at its folder (issue 22 item 8).

TRL's colocated vLLM starts from `model.name_or_path`; the freshly trained model's is '', so
`scripts/trl_grpo.py --engine vllm` trained for two minutes and then failed on an empty cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.hf


def test_trained_now_model_points_at_its_cached_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from routereplay.rl.model import load_or_train

    monkeypatch.setenv("ROUTEREPLAY_CACHE", str(tmp_path / "cache"))  # empty: nothing there yet
    model, tokenizer, source = load_or_train("qwen3_moe", steps=1)
    assert source.startswith("trained now"), source
    folder = Path(model.name_or_path)
    assert folder.parent == tmp_path / "cache", f"name_or_path {model.name_or_path!r} is not the cached folder"
    assert (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()
    assert not model.training, "the returned model is in eval mode, like the cached one"

    cached, cached_tokenizer, source = load_or_train("qwen3_moe", steps=1)
    assert source == f"cached: {folder}"
    assert cached.name_or_path == model.name_or_path
    for (name, value), (_, again) in zip(model.state_dict().items(), cached.state_dict().items(), strict=True):
        assert torch.equal(value, again), f"{name}: the trained-now model differs from the cached one"
    assert tokenizer("1+2=").input_ids == cached_tokenizer("1+2=").input_ids
