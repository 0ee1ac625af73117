"""Which op of an engine's forward pass goes wrong: one prefill through an artifact, every call the
rendered model makes to kernels/ops.py run twice on the same inputs - the Triton path (what serves
on the GPU) and the torch reference path - and their outputs (and any input either one writes, such
as the KV cache) compared. Prints one line per call and names the first whose relative error is
past --threshold; the Triton path's result is what the pass carries on with.

    python benchmarks/ops_check.py --artifact ART [--tokens 120] [--variants tuned,untuned,unfused]
    python benchmarks/ops_check.py --tiny-fp8-moe DIR [--tokens 120]

--tiny-fp8-moe builds the checkpoint and artifact of tests/test_fused_moe_fp8_gpu.py's
test_tuned_fp32_fp8_moe_engine_matches_transformers into DIR (a tiny Qwen3-MoE, --quant fp8, fp32,
tuned here) and also compares the pass's logits with that test's transformers emulation. Variants:
``tuned`` (the artifact's table), ``untuned`` (every launcher's default config), ``unfused`` (the
table, with the FP8 input quantised in a launch of its own: ops.FUSE_ACT_QUANT_FP8 off). The
checking itself is tests/op_check.py's.

What it found (H100, thirty-second session): every call within 1.3e-4 of its reference (the FP8
GEMMs; at most 1.7e-7 in the CPU interpreter's prefill), the same logits under all three
variants, and those logits 0.488 of their spread from the emulation on average (top-1 0.817). The
CPU reproduces that distance with 1e-4 or 3e-4 relative noise added to each FP8 GEMM's output
(0.24-0.38 of the distance to the unquantised model over 16 draws, top-1 0.71-0.86): Hopper's FP8
accumulation, compounded by the e4m3 roundings it flips, not a wrong kernel.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

VARIANTS = ("tuned", "untuned", "unfused")


def prefill_logits(art: Any, tokens: list[int]) -> torch.Tensor:
    from pagecast.runtime.forward_context import ForwardContext

    dev, m = art.device, art.manifest
    n, bs = len(tokens), m.block_size
    num_blocks = math.ceil(n / bs) + 1
    kv = torch.zeros((m.dims["num_layers"], 2, num_blocks, m.kv_heads_per_rank, bs, m.dims["head_dim"]),
                     dtype=art.kv_cache_dtype, device=dev)  # fmt: skip
    art.model.bind_kv_cache(kv)
    ctx = ForwardContext(
        slot_mapping=torch.arange(n, dtype=torch.int64, device=dev),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=dev)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        max_query_len=n,
        max_seq_len=n,
        logits_indices=torch.arange(n, dtype=torch.int64, device=dev),
    )
    with torch.inference_mode():
        ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
        hidden = art.model.forward(ids, torch.arange(n, dtype=torch.int64, device=dev), ctx)
        return art.model.compute_logits(hidden).float().cpu()


def build_tiny_fp8_moe(out: Path) -> tuple[Path, Path]:
    from conftest import build_artifact
    from tiny_models import make_checkpoint

    ckpt = make_checkpoint(out / "ckpt", "qwen3_moe", hidden_size=256, moe_intermediate_size=128)
    art = build_artifact(ckpt, out / "art", gpu="auto", dtype="float32", quant="fp8", tune_budget_s=30.0)
    return ckpt, art


def emulation_logits(ckpt: Path, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The test's reference: transformers with the same FP8 experts and per-token activation
    quantisation, and the unquantised model (how far apart the two are)."""
    from test_fp8_moe import quantised_modules, reference_model
    from transformers import AutoModelForCausalLM

    emulation = reference_model(ckpt, quantised_modules(ckpt), "token")
    plain = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        return emulation(torch.tensor([tokens])).logits[0].float(), plain(torch.tensor([tokens])).logits[0].float()


def main() -> None:
    from pagecast.kernels import ops
    from pagecast.runtime.loader import load_artifact

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--artifact", type=Path)
    src.add_argument("--tiny-fp8-moe", type=Path, help="build the failing GPU test's tiny FP8 Qwen3-MoE here first")
    ap.add_argument("--tokens", type=int, default=120, help="prefill length")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threshold", type=float, default=1e-4, help="relative error that flags a call")
    args = ap.parse_args()

    tokens = torch.randint(3, 4000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = None
    if args.tiny_fp8_moe is not None:
        ckpt, path = build_tiny_fp8_moe(args.tiny_fp8_moe)
        expected, plain = emulation_logits(ckpt, tokens)
    else:
        path = args.artifact
    from kv_cache_support import logit_agreement
    from op_check import OpChecker

    if expected is not None:
        print(f"unquantised model against the emulation: {logit_agreement(plain, expected)}")
    art = load_artifact(path, load_tokenizer=False)
    art.wait_verified()
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            sys.exit(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
        ops.activate(art.kernels if variant != "untuned" else ops.configure({}, use_triton=True, pdl=art.kernels.pdl))
        fused_before = ops.FUSE_ACT_QUANT_FP8
        ops.FUSE_ACT_QUANT_FP8 = variant != "unfused" and fused_before
        try:
            with OpChecker(ops) as checker:
                logits = prefill_logits(art, tokens)
        finally:
            ops.FUSE_ACT_QUANT_FP8 = fused_before
        print(f"{variant}: {len(checker.rows)} op calls, a {len(tokens)}-token prefill")
        print(checker.report(args.threshold))
        if expected is not None:
            print(f"{variant}: engine against the emulation: {logit_agreement(logits, expected)}")


if __name__ == "__main__":
    main()
