"""Attention of a mixed batch (decode rows and prefill chunks in one step) on one GPU: the prefill
kernel over every row, as the engine runs a mixed step, against the decode kernel over the decode
rows plus the prefill kernel over the rest.

    python benchmarks/mixed_attention.py [--cases 1000x600+14x512,...] [--kv bf16,fp8] [--json FILE]

A case ``DxC+PxL`` is D decode sequences of C cached tokens each (one new token) followed by P
prompts of L new tokens (no cached prefix), as a W1 step lays them out (running requests first,
then newly admitted prompts). Llama-3-8B attention shapes (32 query heads over 8 KV heads,
head_dim 128, KV block size 16, q bf16), KV blocks drawn at random from one pool.

Each kernel is timed at every config its tuner would time (problems.config_space, launches in a
CUDA graph, CUDA events, median of --reps replays, tuning.time_launches) and the best is kept, for
both ways: ``unified`` the prefill kernel over all rows; ``split`` the decode kernel over the
first D sequences plus the prefill kernel over the prompts (each at its best config, then the
pair timed together at those configs).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pagecast.kernels import paged_decode_attention as dec
from pagecast.kernels import paged_prefill_attention as pre
from pagecast.kernels import problems, tuning

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def shapes(kv: str) -> tuning.ModelShapes:
    return tuning.ModelShapes(
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, hidden=4096, intermediate=14336,
        block_size=BLOCK, dtype="bfloat16", max_model_len=32768, max_num_seqs=1024,
        kv_cache_dtype="float8_e4m3fn" if kv == "fp8" else None,
    )  # fmt: skip


def mixed_inputs(kv: str, decodes: int, context: int, prompts: int, prompt_len: int) -> dict[str, object]:
    """One mixed step's attention inputs: decode sequences first, then whole prompts."""
    g = torch.Generator(device="cuda").manual_seed(0)
    seq_lens = [context + 1] * decodes + [prompt_len] * prompts
    q_lens = [1] * decodes + [prompt_len] * prompts
    blocks = [-(-n // BLOCK) for n in seq_lens]
    pool = sum(blocks) + 1
    cache_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16

    def cache() -> torch.Tensor:
        x = torch.randn((pool, KV_HEADS, BLOCK, HEAD_DIM), generator=g, device="cuda", dtype=torch.bfloat16)
        return (x * 0.5).to(cache_dtype)

    perm = torch.randperm(pool - 1, device="cuda", generator=g).to(torch.int32)
    table = torch.zeros((len(seq_lens), max(blocks)), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[used : used + n]
        used += n
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn((int(qsl[-1]), HEADS, HEAD_DIM), generator=g, device="cuda", dtype=torch.bfloat16)
    return {
        "q": q, "k_cache": cache(), "v_cache": cache(), "block_tables": table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), "query_start_loc": qsl,
        "out": torch.empty_like(q), "decodes": decodes, "max_seq_len": max(seq_lens),
    }  # fmt: skip


def unified(x: dict, cfg: tuning.KernelConfig) -> object:
    return pre.paged_prefill_attention(
        x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["query_start_loc"],
        HEAD_DIM**-0.5, config=cfg, out=x["out"],
    )  # fmt: skip


def decode_part(x: dict, cfg: tuning.KernelConfig) -> object:
    d = x["decodes"]
    return dec.paged_decode_attention(
        x["q"][:d], x["k_cache"], x["v_cache"], x["block_tables"][:d], x["seq_lens"][:d],
        x["query_start_loc"][: d + 1], HEAD_DIM**-0.5, x["max_seq_len"], config=cfg, out=x["out"][:d],
    )  # fmt: skip


def prefill_part(x: dict, cfg: tuning.KernelConfig) -> object:
    d = x["decodes"]
    return pre.paged_prefill_attention(
        x["q"][d:], x["k_cache"], x["v_cache"], x["block_tables"][d:], x["seq_lens"][d:],
        x["prefill_qsl"], HEAD_DIM**-0.5, config=cfg, out=x["out"][d:],
    )  # fmt: skip


def best(fn, x: dict, configs: list[tuning.KernelConfig], reps: int) -> tuple[float, tuning.KernelConfig]:
    timed = []
    for cfg in configs:
        try:
            timed.append((tuning.time_launches(lambda i, cfg=cfg: fn(x, cfg), 1, reps), cfg))
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: that config cannot run
            print(f"  skipped {cfg.as_dict()}: {type(exc).__name__}")
            torch.cuda.synchronize()
    return min(timed, key=lambda t: t[0])


def measure(case: str, kv: str, decodes: int, context: int, prompts: int, prompt_len: int, reps: int) -> dict:
    """One case and KV dtype: the best unified time against the best split (see the module docstring)."""
    sh = shapes(kv)
    x = mixed_inputs(kv, decodes, context, prompts, prompt_len)
    x["prefill_qsl"] = x["query_start_loc"][decodes:] - decodes
    pre_space = problems.config_space("paged_prefill_attention", sh, {"num_tokens": 8192})
    dec_space = problems.config_space(
        "paged_decode_attention", sh, {"num_seqs": decodes, "max_seq_len": context + 1}
    )
    t_uni, c_uni = best(unified, x, pre_space, reps)
    t_dec, c_dec = best(decode_part, x, dec_space, reps)
    t_pre, c_pre = best(prefill_part, x, pre_space, reps)
    t_split = tuning.time_launches(lambda i: (decode_part(x, c_dec), prefill_part(x, c_pre)), 1, reps)
    # The split computes what the unified launch does (same inputs, same outputs).
    unified(x, c_uni)
    ref = x["out"].clone()
    decode_part(x, c_dec), prefill_part(x, c_pre)
    err = ((x["out"].float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    row = {
        "case": case, "kv": kv, "unified_us": round(t_uni, 1), "split_us": round(t_split, 1),
        "decode_part_us": round(t_dec, 1), "prefill_part_us": round(t_pre, 1),
        "split_over_unified": round(t_split / t_uni, 3), "max_rel_diff": err,
        "configs": {"unified": c_uni.as_dict(), "decode": c_dec.as_dict(), "prefill": c_pre.as_dict()},
    }  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="1000x600+14x512,512x600+15x512,128x600+15x512,16x600+15x512")
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = []
    for case in args.cases.split(","):
        dpart, ppart = case.split("+")
        decodes, context = (int(v) for v in dpart.split("x"))
        prompts, prompt_len = (int(v) for v in ppart.split("x"))
        for kv in args.kv.split(","):
            try:
                rows.append(measure(case, kv, decodes, context, prompts, prompt_len, args.reps))
            except Exception as exc:  # noqa: BLE001 - report the case and go on to the next
                print(f"{case} {kv}: {type(exc).__name__}: {exc}", flush=True)
            torch.cuda.empty_cache()
    print("\n| case (decodes x context + prompts x tokens) | KV | prefill kernel, all rows | decode + prefill kernels "
          "| decode part | prefill part | split / unified |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['kv']} | {r['unified_us']} us | {r['split_us']} us | {r['decode_part_us']} us "
              f"| {r['prefill_part_us']} us | {r['split_over_unified']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
