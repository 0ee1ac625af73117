"""What W8A8 FP8 costs in perplexity by itself, without pagecast (issue 29): the embedded
SmolLM2-135M-Instruct in transformers (fp32), every decoder projection (q/k/v/o, gate/up/down)
quantised in plain torch - weights to e4m3 per output channel (amax / 448, round to nearest),
inputs to e4m3 per token at run time - against the float model, on text shipped with Python
(pydoc_data.topics). Variants leave parts in float to show where the cost comes from, or search
each weight row's scale for the least squared error (clipping) instead of amax / 448.

    python benchmarks/fp8_format_cost.py [--tokens 4096] [--window 1024] [--variants "NAME;NAME"]

Prints token perplexity per variant and its change against float. benchmarks/perplexity.py
measures pagecast's own ``--quant fp8`` through engine-serve (word perplexity); this script says
how much of that any W8A8 implementation of the same format would lose.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

E4M3_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VARIANTS = {  # name -> (quantise weights ("mse": clipped scales), quantise activations, module-name parts left in float)
    "fp8 weights and activations": (True, True, ()),
    "fp8 weights only": (True, False, ()),
    "fp8 activations only": (False, True, ()),
    "all but down_proj": (True, True, ("down_proj",)),
    "all but the first and last layers": (True, True, ("layers.0.", "layers.29.")),
    "weights with MSE-clipped scales, and activations": ("mse", True, ()),
    "weights only, MSE-clipped scales": ("mse", False, ()),
    # the fine-grained block format (FP8_BLOCK, the official Qwen3/DeepSeek FP8 releases): weights in
    # 128 x 128 blocks, activations in 1 x 128 groups of each token
    "128x128 block weights, 1x128 group activations": ("block", "group", ()),
    "per-channel weights, 1x128 group activations": (True, "group", ()),
    "1x128 group activations only": (False, "group", ()),
    "128x128 block weights only": ("block", False, ()),
}
GROUP = 128
CLIP_RATIOS = tuple(1.0 - 0.02 * i for i in range(21))  # the clipped scales' search: amax x 1.0 ... 0.6


def fp8_round_trip(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x through e4m3 and back, one scale per slice along ``dim`` (amax / 448)."""
    scale = x.abs().amax(dim=dim, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def _padded(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """x with zeros appended along ``dims`` up to a multiple of GROUP (SmolLM2's 576 is 4.5 groups)."""
    pad = [0] * (2 * x.dim())
    for d in dims:
        pad[2 * (x.dim() - 1 - d) + 1] = -x.shape[d] % GROUP
    return torch.nn.functional.pad(x, pad)


def fp8_group_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] through e4m3 and back, one scale (amax / 448) per GROUP consecutive elements of
    the last dimension (the block format's per-token-group activation scales)."""
    k = x.shape[-1]
    g = _padded(x, (x.dim() - 1,))
    g = g.reshape(*g.shape[:-1], -1, GROUP)
    return fp8_round_trip(g, -1).reshape(*x.shape[:-1], -1)[..., :k]


def fp8_block_round_trip(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] through e4m3 and back, one scale (amax / 448) per GROUP x GROUP block."""
    n, k = w.shape
    b = _padded(w, (0, 1))
    blocks = b.reshape(b.shape[0] // GROUP, GROUP, b.shape[1] // GROUP, GROUP)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12) / E4M3_MAX
    q = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(b.shape)[:n, :k]


def fp8_clipped_round_trip(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] through e4m3 and back, each output row's scale (amax x r / 448) at the clip
    ratio r of CLIP_RATIOS that gives the row the least squared error (an MSE observer)."""
    amax = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    best, best_err = None, None
    for r in CLIP_RATIOS:
        scale = amax * r / E4M3_MAX
        q = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
        err = ((q - w) ** 2).sum(dim=1, keepdim=True)
        if best is None or best_err is None:
            best, best_err = q, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, q, best), torch.where(better, err, best_err)
    assert best is not None
    return best


def perplexity(model: torch.nn.Module, ids: torch.Tensor, window: int) -> float:
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, ids.shape[1] - 1, window):
            chunk = ids[:, start : start + window + 1]
            predicted = chunk.shape[1] - 1
            nll += model(chunk, labels=chunk).loss.item() * predicted
            count += predicted
    return math.exp(nll / count)


def quantised(path: Path, weights: bool | str, activations: bool | str, keep: tuple[str, ...]) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        if any(part in name for part in keep):
            continue
        if weights == "mse":
            module.weight.data = fp8_clipped_round_trip(module.weight.data)
        elif weights == "block":
            module.weight.data = fp8_block_round_trip(module.weight.data)
        elif weights:
            module.weight.data = fp8_round_trip(module.weight.data, 1)
        if activations == "group":
            module.register_forward_pre_hook(lambda _module, args: (fp8_group_round_trip(args[0]), *args[1:]))
        elif activations:
            module.register_forward_pre_hook(lambda _module, args: (fp8_round_trip(args[0], -1), *args[1:]))
    return model


def main() -> None:
    import pydoc_data.topics

    from tiny_models import smollm2_dir
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens scored")
    ap.add_argument("--window", type=int, default=1024, help="tokens predicted per forward pass")
    ap.add_argument("--variants", default="", help="variant names, separated by ';' (default: every one)")
    args = ap.parse_args()
    path = smollm2_dir()
    text = "\n\n".join(list(pydoc_data.topics.topics.values())[:40])
    ids = AutoTokenizer.from_pretrained(path)(text, return_tensors="pt").input_ids[:, : args.tokens + 1]
    base = perplexity(quantised(path, False, False, ()), ids, args.window)
    print(f"{ids.shape[1] - 1} tokens scored; token perplexity")
    print(f"  {'float':<36}{base:9.4f}")
    for name, (weights, activations, keep) in VARIANTS.items():
        if args.variants and name not in args.variants.split(";"):
            continue
        ppl = perplexity(quantised(path, weights, activations, keep), ids, args.window)
        print(f"  {name:<36}{ppl:9.4f}  {100 * (ppl / base - 1):+.2f}%")


if __name__ == "__main__":
    main()
