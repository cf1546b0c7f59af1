"""MTP (multi-token prediction) layers stay natural on the HF side, as they do in `attach_megatron`.

transformers builds MTP layers as modules for `generate(use_mtp=True)`: `MtpModel(main, n)` (in
`transformers.modeling_layers`) holds `MtpLayer`s whose `mtp_block` is a decoder layer of the main
model's class, numbered from 0 again. A router there must not take decoder layer k's routes
(NeMo-RL #3903): it is left natural and listed with the reason, and a router numbered past the
decoder's `num_hidden_layers` (an MTP layer appended to `model.layers`) likewise. The truth is the
MTP router's own top-k inside a replay context that forces other experts in decoder layer 0.

Legend: B = batch rows, S = positions, L = layers, K = top-k, T = tokens, H = hidden.
"""

from __future__ import annotations

import pytest
import torch

from routereplay.errors import UnsupportedRouterError
from routereplay.runtime import attach
from routereplay.testing.hf.models import tiny_config
from tests.runtime.models import tiny_qwen3

transformers = pytest.importorskip("transformers")
from transformers.modeling_layers import MtpModel  # noqa: E402

EXPERTS, TOP_K = 8, 2


def _deepseek_with_mtp() -> torch.nn.Module:
    config = tiny_config(  # two MoE decoder layers, one expert group, one MTP layer
        "deepseek_v3",
        num_hidden_layers=2,
        first_k_dense_replace=0,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        n_group=1,
        topk_group=1,
        num_mtp_layers=1,
    )
    torch.manual_seed(0)
    main = transformers.AutoModelForCausalLM.from_config(config).eval()
    mtp = MtpModel(main, config.num_mtp_layers)  # the draft layers, held beside the decoder
    with torch.no_grad():  # built for loading a checkpoint: give the draft block values of its own
        for name, tensor in mtp.layers.named_parameters():
            tensor.copy_(torch.ones_like(tensor) if "norm" in name else torch.randn_like(tensor) * 0.1)
        for tensor in mtp.layers.buffers():
            if tensor.is_floating_point():
                tensor.zero_()
    main.mtp = mtp
    return main


def test_mtp_router_is_left_natural_and_named() -> None:
    model = _deepseek_with_mtp()
    replayer = attach(model)
    assert replayer.layers == (0, 1)
    assert [s.name for s in replayer.sites] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    natural = [r for r in replayer.refused if r.natural_ok]
    assert [r.name for r in natural] == ["mtp.layers.0.mtp_block.mlp.gate"]
    assert "left natural mtp.layers.0.mtp_block.mlp.gate" in replayer.describe()
    assert "MTP layer (under MtpModel 'mtp')" in replayer.describe()


def test_mtp_router_routes_live_while_decoder_layer_0_replays() -> None:
    model = _deepseek_with_mtp()
    replayer = attach(model)
    ids_BS = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    hidden_BSH = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    decoder_moe, mtp_moe = model.model.layers[0].mlp, model.mtp.layers[0].mtp_block.mlp  # both "layer 0"
    with torch.no_grad():
        natural = decoder_moe(hidden_BSH), mtp_moe(hidden_BSH)
        with replayer.record() as rec:
            model(input_ids=ids_BS)
        forced_BSLK = (rec.routes + 1) % EXPERTS  # other experts than the live ones, in every decoder layer
        with replayer.replay(forced_BSLK):
            replayed = decoder_moe(hidden_BSH), mtp_moe(hidden_BSH)
    assert not torch.equal(replayed[0], natural[0])  # decoder layer 0 takes the forced experts
    assert torch.equal(replayed[1], natural[1])  # the MTP layer numbered 0 routes live
    assert rec.routes.shape[2:] == (2, TOP_K)  # routes cover the decoder layers only


def test_mtp_model_alone_is_refused_by_name() -> None:
    main = _deepseek_with_mtp()
    with pytest.raises(
        UnsupportedRouterError, match=r"MtpModel holds only MTP \(draft\) routers.*Attach the main model"
    ):
        attach(MtpModel(main, 1))


def test_router_past_num_hidden_layers_is_left_natural() -> None:
    model = tiny_qwen3(layers=3, experts=EXPERTS, top_k=TOP_K)
    model.config.num_hidden_layers = 2  # a checkpoint whose model.layers carries one appended MTP layer
    replayer = attach(model)
    assert replayer.layers == (0, 1)
    (natural,) = replayer.refused
    assert natural.natural_ok and natural.name == "model.layers.2.mlp.gate"
    assert "past the decoder's num_hidden_layers=2" in replayer.describe()
