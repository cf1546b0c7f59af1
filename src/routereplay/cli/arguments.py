"""Argument groups shared by several subcommands, and parsers for their value syntaxes."""

from __future__ import annotations

import argparse

from routereplay.tracefile import FileFormat, PayloadHints


def layer_list(text: str) -> list[int]:
    """Parse "1-47", "1,3,5" or "0,2-4" into a list of global layer numbers."""
    layers: list[int] = []
    try:
        for part in text.split(","):
            if "-" in part:
                low, high = (int(x) for x in part.split("-", 1))
                if high < low:
                    raise ValueError(part)
                layers.extend(range(low, high + 1))
            elif part.strip():
                layers.append(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad layer list {text!r}; use e.g. 1-47 or 0,2,4-6") from None
    if not layers or min(layers) < 0:
        raise argparse.ArgumentTypeError(f"layer list {text!r} must name non-negative layers")
    return layers


def add_payload_arguments(parser: argparse.ArgumentParser) -> None:
    """Options that say what an engine payload does not: model facts and which sequence."""
    group = parser.add_argument_group(
        "engine payloads", "model facts an engine payload does not carry (from the model's config.json)"
    )
    group.add_argument(
        "--engine", choices=[f.value for f in FileFormat], help="input format (default: recognised from the bytes)"
    )
    group.add_argument("--num-experts", type=int, help="routed experts per MoE layer (n_routed_experts / num_experts)")
    group.add_argument("--num-layers", type=int, help="layers in the payload: every hidden layer (SGLang: required)")
    group.add_argument("--top-k", type=int, help="experts per token (num_experts_per_tok; SGLang: required)")
    group.add_argument(
        "--moe-layers",
        type=layer_list,
        help="global numbers of the MoE layers to keep from an all-layer payload, e.g. 1-47",
    )
    group.add_argument(
        "--num-tokens", type=int, help="prompt + generated tokens: checks rows == num_tokens - 1 - start"
    )
    group.add_argument("--start", type=int, default=0, help="token position of row 0 (prompt_start / start_len)")
    group.add_argument("--index", type=int, default=0, help="choice / request index inside a response (default 0)")


def payload_hints(args: argparse.Namespace) -> PayloadHints:
    return PayloadHints(
        num_experts=args.num_experts,
        num_layers=args.num_layers,
        top_k=args.top_k,
        moe_layers=args.moe_layers,
        num_tokens=args.num_tokens,
        start=args.start,
        index=args.index,
    )


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


__all__ = ["add_json_argument", "add_payload_arguments", "layer_list", "payload_hints"]
