"""Which op of an engine's forward pass goes wrong: one prefill through an artifact, every call the
rendered model makes to kernels/ops.py run twice on the same inputs - the Triton path (what serves
on the GPU) and the torch reference path - and their outputs (and any input either one writes, such
as the KV cache) compared. Prints one line per call and names the first whose relative error is
past --threshold; the Triton path's result is what the pass carries on with.

    python benchmarks/ops_check.py --artifact ART [--tokens 120] [--variants tuned,untuned,unfused]
    python benchmarks/ops_check.py --tiny-fp8-moe DIR [--tokens 120]

--tiny-fp8-moe builds the checkpoint and artifact of tests/test_fused_moe_fp8_gpu.py's
test_tuned_fp32_fp8_moe_engine_matches_transformers into DIR (a tiny Qwen3-MoE, --quant fp8, fp32,
tuned here) and also compares the pass's logits with that test's transformers emulation. On an H100
(thirtieth session) that engine's 120-token prefill disagreed with the emulation (top-1 0.817, mean
0.488 of the logits' spread) while the CPU interpreter running the same kernels agreed (0.0045):
this names the op on the GPU. Variants: ``tuned`` (the artifact's table), ``untuned`` (every
launcher's default config), ``unfused`` (the table, with the FP8 input quantised in a launch of its
own: ops.FUSE_ACT_QUANT_FP8 off).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

OPS = ("norm_linear", "linear", "row_parallel_linear", "rotary_and_write_kv", "paged_attention", "fused_add_rms_norm",
       "rms_norm", "add_norm_moe", "moe", "lm_head", "embedding")  # fmt: skip
VARIANTS = ("tuned", "untuned", "unfused")


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    g, w = got.float(), want.float()
    return float((g - w).norm() / w.norm().clamp_min(1e-30))


class Checker:
    """Wraps each of OPS: the reference path on copies of the inputs, then the Triton path on the
    inputs themselves; records (op, rows, output error, written-input error)."""

    def __init__(self, ops: Any, threshold: float) -> None:
        self.ops, self.threshold = ops, threshold
        self.triton_on = True
        self.depth = 0
        self.rows: list[tuple[str, int, float, float]] = []
        self.originals = {name: getattr(ops, name) for name in OPS if hasattr(ops, name)}
        self.plain_triton = ops._triton
        ops._triton = lambda x: self.triton_on and self.plain_triton(x)
        for name, fn in self.originals.items():
            setattr(ops, name, self._wrap(name, fn))

    def close(self) -> None:
        for name, fn in self.originals.items():
            setattr(self.ops, name, fn)
        self.ops._triton = self.plain_triton

    def _wrap(self, name: str, fn: Any) -> Any:
        def checked(*args: Any, **kwargs: Any) -> Any:
            if self.depth:  # an op called from inside another: checked as part of it
                return fn(*args, **kwargs)
            self.depth += 1
            try:
                ref_args, ref_kwargs = _clone(args), _clone(kwargs)
                self.triton_on = False
                want = fn(*ref_args, **ref_kwargs)
                self.triton_on = True
                got = fn(*args, **kwargs)
            finally:
                self.triton_on = True
                self.depth -= 1
            out = max((_relative(g, w) for g, w in zip(_tensors(got), _tensors(want), strict=False)), default=0.0)
            written = max(
                (_relative(g, w) for g, w in zip(_tensors((args, kwargs)), _tensors((ref_args, ref_kwargs)), strict=False)),
                default=0.0,
            )  # fmt: skip
            rows = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) else 0
            self.rows.append((name, rows, out, written))
            return got

        return checked

    def report(self) -> None:
        first = None
        for i, (name, rows, out, written) in enumerate(self.rows):
            flag = "  <-- past the threshold" if max(out, written) > self.threshold else ""
            if flag and first is None:
                first = i
            print(f"  {i:4d} {name:20s} rows={rows:5d} output {out:.3e}  written inputs {written:.3e}{flag}")
        if first is None:
            print(f"  every call within {self.threshold:g}")
        else:
            print(f"  FIRST PAST {self.threshold:g}: call {first}, {self.rows[first][0]}")


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
        checker = Checker(ops, args.threshold)
        try:
            logits = prefill_logits(art, tokens)
        finally:
            checker.close()
            ops.FUSE_ACT_QUANT_FP8 = fused_before
        print(f"{variant}: {len(checker.rows)} op calls, a {len(tokens)}-token prefill")
        checker.report()
        if expected is not None:
            print(f"{variant}: engine against the emulation: {logit_agreement(logits, expected)}")


if __name__ == "__main__":
    main()
