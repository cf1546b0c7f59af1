"""`routereplay.layout` exports what the README names (issue 11 item 33)."""

from __future__ import annotations

import torch


def test_layout_exports_the_names_the_readme_uses() -> None:
    """Error that is not a RouteReplayError (issue 11 item 33): the README's `layout.plan`, `gather` and
    `token_index` raised AttributeError / ImportError from `routereplay.layout`."""
    from routereplay import layout

    assert {"plan", "gather", "token_index"} <= set(layout.__all__)
    index_BS = layout.token_index(2, 3)
    routes_BSLK = torch.arange(2 * 3 * 1 * 2).reshape(2, 3, 1, 2)
    assert torch.equal(layout.gather(routes_BSLK, index_BS[:, :2], source_dims=2), routes_BSLK[:, :2])
    assert layout.plan.gather is layout.gather
