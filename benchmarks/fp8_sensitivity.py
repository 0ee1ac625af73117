"""Where FP8's perplexity cost comes from (issue 29: ``--quant fp8`` within 1% word perplexity of
bf16 on the embedded SmolLM2-135M): transformers runs the model in fp32 on the CPU with chosen
projections replaced by pagecast's exact FP8 emulation (the build's per-channel e4m3 weights,
builder/fp8.quantise_weight, and the W8A8 linear with per-token activations,
kernels/reference.fp8_linear), and scores text from benchmarks/perplexity.py's source. Each row
keeps some projections in float; rows are relative to the float model on the same windows.

    python benchmarks/fp8_sensitivity.py [--tokens 12288] [--window 1024] [--scan down_proj]

``--scan KIND`` adds a row per layer with that layer's KIND projection kept in float. This is an
analysis on the CPU, not the served figure: benchmarks/perplexity.py measures that through
engine-serve (its windows and scoring differ, so the percentages do too).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Fp8Linear(torch.nn.Module):
    """A Linear whose weight and input go through e4m3 as the artifact's would (either may be
    switched off to see its share)."""

    def __init__(self, linear: torch.nn.Linear):
        from pagecast.builder.fp8 import quantise_weight

        super().__init__()
        self.linear = linear
        self.qw, self.w_scale = quantise_weight(linear.weight.data)
        self.weights, self.activations = False, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pagecast.kernels import reference

        rows = x.reshape(-1, x.shape[-1])  # the reference takes [tokens, K]
        if self.activations and self.weights:
            y = reference.fp8_linear(rows, self.qw, self.w_scale, "token", bias=self.linear.bias)
            return y.reshape(*x.shape[:-1], -1)
        w = reference.dequantize_fp8(self.qw, self.w_scale) if self.weights else self.linear.weight
        if self.activations:
            qx, xs = reference.quantize_fp8_rows(rows)
            x = (qx.float() * xs[:, None]).reshape(x.shape)
        return torch.nn.functional.linear(x, w, self.linear.bias)


def text_ids(tokenizer, tokens: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The Python language reference's topics (benchmarks/perplexity.py's source, joined whole
    here rather than cut per document), the first ``tokens`` tokens."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return tokenizer(text, return_tensors="pt").input_ids[0][:tokens]


def total_nll(model, ids: torch.Tensor, window: int) -> float:  # type: ignore[no-untyped-def]
    """Summed negative log-likelihood of ids[1:] over disjoint windows."""
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start : start + window + 1]
            logprobs = torch.log_softmax(model(chunk[None, :-1]).logits[0].float(), dim=-1)
            total -= logprobs.gather(1, chunk[1:, None]).sum().item()
    return total


def main() -> None:
    from tiny_models import smollm2_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=12288)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--scan", choices=PROJECTIONS, default=None, help="a row per layer with this projection kept in float")
    args = ap.parse_args()

    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = text_ids(tokenizer, args.tokens)
    words = len(tokenizer.decode(ids).split())
    fp8: dict[tuple[int, str], Fp8Linear] = {}
    for i, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for kind in PROJECTIONS:
                if isinstance(getattr(parent, kind, None), torch.nn.Linear):
                    fp8[i, kind] = Fp8Linear(getattr(parent, kind))
                    setattr(parent, kind, fp8[i, kind])
    num_layers = len(model.model.layers)

    def configure(float_kinds: tuple[str, ...] = (), float_at: tuple[int, str] | None = None,
                  weights: bool = True, activations: bool = True) -> None:  # fmt: skip
        for (i, kind), m in fp8.items():
            quantised = kind not in float_kinds and (i, kind) != float_at
            m.weights, m.activations = quantised and weights, quantised and activations

    rows: list[tuple[str, dict]] = [
        ("float (all projections)", {"float_kinds": PROJECTIONS}),
        ("fp8 (every projection)", {}),
        ("fp8 weights only", {"activations": False}),
        ("fp8 activations only", {"weights": False}),
        ("float q/k/v", {"float_kinds": ("q_proj", "k_proj", "v_proj")}),
        ("float o", {"float_kinds": ("o_proj",)}),
        ("float gate/up", {"float_kinds": ("gate_proj", "up_proj")}),
        ("float down", {"float_kinds": ("down_proj",)}),
    ]
    if args.scan:
        rows += [(f"float {args.scan} of layer {i}", {"float_at": (i, args.scan)}) for i in range(num_layers)]
    print(f"SmolLM2-135M, {len(ids) - 1} tokens predicted ({words} words), windows of {args.window}")
    print("| row | token ppl | token ppl vs float | word ppl vs float |")
    print("| --- | --- | --- | --- |")
    base = None
    for label, options in rows:
        t0 = time.perf_counter()
        configure(**options)
        nll = total_nll(model, ids, args.window)
        base = nll if base is None else base
        token = math.exp((nll - base) / (len(ids) - 1)) - 1
        word = math.exp((nll - base) / words) - 1
        print(f"| {label} | {math.exp(nll / (len(ids) - 1)):.4f} | {token:+.2%} | {word:+.2%} |"
              f"  <!-- {time.perf_counter() - t0:.0f} s -->", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
