"""MoE routing benchmark (issue 27): a MoE layer's routing on one GPU, per layer, captured in a
CUDA graph as decode steps run (tuning.time_launches: the median of graph replays over 48
launches, one per layer of Qwen3-30B-A3B, each with its own router weight so none is read from
the last launch's L2), at the routers of

    qwen3-30b-a3b   hidden 2048, 128 experts top-8, renormalised, weights in bf16
    mixtral-8x7b    hidden 4096, 8 experts top-2, renormalised, weights in fp32
    gpt-oss-20b     hidden 2880, 32 experts top-4, top-k then softmax, router bias

and 1, 16 and 256 tokens, bf16:

    gemv    the router logits alone (F.linear), the part both paths share
    torch   what ops.moe ran before: F.linear, then moe_routing.route_torch (softmax, topk, sum,
            divide, cast), then fused_moe's .float() of the weights
    kernel  what ops.moe runs unfused: route(..., use_kernel=True, widen=True), F.linear and the
            routing kernel (kernels/moe_route_kernel.py) writing fp32 weights
    fused   the router GEMV and the routing in one launch (moe_route_kernel.router_route), each
            pruned config of FUSED_CONFIG_SPACE (path "fused <config>"), up to 16 tokens; the
            build's tuner times the same against "kernel" per token bucket ("moe_router")

    python benchmarks/moe_routing.py [--tokens 1,16,256] [--out DIR]

One JSON line per figure (also DIR/moe_routing.jsonl with --out).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from pagecast.kernels import moe_route_kernel, tuning
from pagecast.kernels.moe_routing import MoeRouting, route, route_torch

LAYERS = 48
ROUTERS = {  # hidden, experts, routing, router bias
    "qwen3-30b-a3b": (2048, 128, MoeRouting(8, renormalize=True, weights_in_x_dtype=True), False),
    "mixtral-8x7b": (4096, 8, MoeRouting(2, renormalize=True), False),
    "gpt-oss-20b": (2880, 32, MoeRouting(4, scoring="topk_softmax"), True),
}


def launches(x: torch.Tensor, weights: list, biases: list, routing: MoeRouting) -> dict[str, Any]:
    """Each path's ``launch(i)`` (layer i's router) on the tokens ``x``."""

    def gemv(i: int) -> object:
        return torch.nn.functional.linear(x, weights[i], biases[i])

    def torch_path(i: int) -> object:
        w, ids = route_torch(gemv(i), routing)
        return w.float(), ids

    def kernel_path(i: int) -> object:
        return route(x, weights[i], biases[i], routing, use_kernel=True, widen=True)

    paths = {"gemv": gemv, "torch": torch_path, "kernel": kernel_path}
    experts, hidden = weights[0].shape
    if moe_route_kernel.fused_supported(x.shape[0], experts, routing.top_k):
        for cfg in moe_route_kernel.prune_configs(moe_route_kernel.FUSED_CONFIG_SPACE, experts, hidden):
            if moe_route_kernel.is_fused(cfg):
                paths[f"fused {json.dumps(cfg.as_dict(), sort_keys=True)}"] = (
                    lambda i, cfg=cfg: route(x, weights[i], biases[i], routing, use_kernel=True, widen=True, config=cfg)
                )
    return paths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,16,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lines = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (hidden, experts, routing, has_bias) in ROUTERS.items():
        weights = [torch.randn(experts, hidden, generator=g, device="cuda").bfloat16() for _ in range(LAYERS)]
        biases = [torch.randn(experts, generator=g, device="cuda").bfloat16() if has_bias else None] * LAYERS
        for tokens in map(int, args.tokens.split(",")):
            x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
            for path, launch in launches(x, weights, biases, routing).items():
                us = tuning.time_launches(launch, LAYERS, args.reps)
                line = {"router": name, "tokens": tokens, "path": path, "us_per_layer": round(us, 2),
                        "us_per_step": round(us * LAYERS, 1)}  # fmt: skip
                print(json.dumps(line), flush=True)
                lines.append(line)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe_routing.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
