"""Where FP8's perplexity cost comes from (issue 29: ``--quant fp8`` within 1% word perplexity of
bf16 on the embedded SmolLM2-135M): transformers runs the model in fp32 on the CPU with chosen
projections replaced by pagecast's exact FP8 emulation (the build's per-channel e4m3 weights,
builder/fp8.quantise_weight, and the W8A8 linear with per-token activations,
kernels/reference.fp8_linear), and scores the documents benchmarks/perplexity.py scores (its
``corpus()``: the same topics, cut the same way, about ``--tokens`` tokens) in lm-eval's rolling
windows (each document after the end-of-text token, ``--window`` tokens predicted a window), word
perplexity over the same word count. Each row keeps some projections in float; rows are relative
to the float model on the same windows. With ``--tokens 6000`` (the served measurement's text) the
float row is within 0.05% of transformers' figure in that measurement.

    python benchmarks/fp8_sensitivity.py [--tokens 12000] [--window 1024] [--max-chars 6000] [--scan down_proj]

``--scan KIND`` adds a row per layer with that layer's KIND projection kept in float. This is an
analysis on the CPU in fp32 transformers, not the served figure: benchmarks/perplexity.py measures
that through engine-serve and lm-eval, against transformers' float model.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).parent))  # perplexity.corpus

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


def documents(tokenizer, tokenizer_dir: Path, tokens: int, max_chars: int) -> tuple[list[torch.Tensor], int]:  # type: ignore[no-untyped-def]
    """perplexity.py's scored documents as token ids, each after the end-of-text token (lm-eval's
    rolling prefix), and their word count (lm-eval's word perplexity divides by it)."""
    from perplexity import corpus

    with tempfile.TemporaryDirectory() as work:
        path, _, info = corpus(Path(work), tokenizer_dir, tokens, max_chars)
        texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    eot = tokenizer.eos_token_id
    ids = [torch.tensor([eot, *tokenizer.encode(t, add_special_tokens=False)]) for t in texts]
    return ids, int(info["words"])


def total_nll(model, docs: list[torch.Tensor], window: int) -> float:  # type: ignore[no-untyped-def]
    """Summed negative log-likelihood of every document's tokens (all but the prefix) in lm-eval's
    rolling windows: ``window`` predictions a window, each window's input the ``window`` tokens
    before its last prediction (a document's last, shorter window so sees the tokens before it)."""
    total = 0.0
    with torch.no_grad():
        for ids in docs:
            for first in range(1, len(ids), window):  # ids[first:last] predicted
                last = min(first + window, len(ids))
                start = max(0, last - 1 - window)
                logits = model(ids[None, start : last - 1]).logits[0, first - 1 - start :]
                logprobs = torch.log_softmax(logits.float(), dim=-1)
                total -= logprobs.gather(1, ids[first:last, None]).sum().item()
    return total


def main() -> None:
    from tiny_models import smollm2_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=12000, help="perplexity.py's --tokens")
    ap.add_argument("--window", type=int, default=1024, help="perplexity.py's --max-length")
    ap.add_argument("--max-chars", type=int, default=6000, help="perplexity.py's --max-chars")
    ap.add_argument("--scan", choices=PROJECTIONS, default=None, help="a row per layer with this projection kept in float")
    args = ap.parse_args()

    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    docs, words = documents(tokenizer, Path(path), args.tokens, args.max_chars)
    predicted = sum(len(d) - 1 for d in docs)
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
    print(f"SmolLM2-135M, {len(docs)} documents, {predicted} tokens predicted ({words} words), windows of {args.window}")
    print("| row | token ppl | token ppl vs float | word ppl vs float |")
    print("| --- | --- | --- | --- |")
    base = None
    for label, options in rows:
        t0 = time.perf_counter()
        configure(**options)
        nll = total_nll(model, docs, args.window)
        base = nll if base is None else base
        token = math.exp((nll - base) / predicted) - 1
        word = math.exp((nll - base) / words) - 1
        print(f"| {label} | {math.exp(nll / predicted):.4f} | {token:+.2%} | {word:+.2%} |"
              f"  <!-- {time.perf_counter() - t0:.0f} s -->", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
