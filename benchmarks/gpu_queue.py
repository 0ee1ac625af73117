"""The GPU measurements still owed, in the order they are worth device time, run one after another
within one device call's limit: each step under its own timeout (a step that hangs costs its
timeout, not the call), its output in OUT/<step>.log, a JSON line per step in OUT/queue.jsonl
(rc, seconds, whether it timed out). A step starts only if its timeout fits in what is left of
``--budget``; ``--from`` resumes at a step in the next call (the machine may be a fresh one, so
each step builds what it needs).

    python benchmarks/gpu_queue.py --out $OUT [--budget 570] [--from STEP] [--only STEP,STEP]
    python benchmarks/gpu_queue.py --list

On the device tool's machine: ``bash benchmarks/device_wheels.sh`` here first (the wheels the GPU
image lacks, the test tokenizer, .whl/setup.sh), then a run with carry [".whl"] and the command
``source .whl/setup.sh && python3 benchmarks/gpu_queue.py --out $OUT``.

The steps and what each decides are in STEPS; benchmarks/RESULTS.md says where each lead stands.
When the queue ends, what the steps wrote in OUT's folders is packed into OUT/bundle.tar.gz
(Triton caches and files over 4 MiB left out; listed in queue.jsonl) and the folders deleted: the
device tool returns at most 8 files, and an artifact's own files would crowd out its tuning
table. Here: ``tar xzf /work/.device/N/bundle.tar.gz``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

PY = sys.executable
KEEP_BYTES = 4 << 20  # files in OUT's folders larger than this are not bundled (weights, not tables)
BUNDLE = "bundle.tar.gz"  # what the steps wrote in OUT's folders, packed when the queue ends


@dataclass(frozen=True)
class Step:
    name: str
    command: list[str]
    timeout_s: int
    decides: str


def _pytest(*args: str, stop_at_first: bool = True) -> list[str]:
    # pytest-timeout's thread method: a test that hangs on the GPU is named, with its stack, and ended
    return [PY, "-m", "pytest", "-m", "gpu", "-q", *(["-x"] if stop_at_first else []), "-p", "no:cacheprovider",
            "--timeout", "120", "--timeout-method", "thread", *args]


def steps(out: Path) -> list[Step]:
    """The queue (``out``: where benchmarks that take --out write)."""
    bench = Path(__file__).parent
    qwen3_w4 = ["env", "PAGECAST_TUNE_STALL_S=120", PY, "benchmarks/families.py", "--models", "qwen3-30b-a3b",
                "--phases", "W4", "--tune-budget", "120", "--out"]  # fmt: skip
    return [
        Step(
            "fp8_moe_ops_check",
            [PY, str(bench / "ops_check.py"), "--tiny-fp8-moe", str(out / "tinymoe"), "--tokens", "120"],
            240,
            "which op of the tuned fp32 FP8 Qwen3-MoE engine goes wrong on the GPU: an H100 failed "
            "test_tuned_fp32_fp8_moe_engine_matches_transformers in the thirtieth session (120-token prefill: top-1 "
            "0.817, mean 0.488 of the logits' spread; passed on an H200 at 9c55d4d), while the CPU interpreter "
            "running the same kernels agreed with the emulation (0.0045); every op against the reference path on "
            "the same inputs, with the tuned table, the launchers' defaults and the FP8 quantisation apart",
        ),
        Step(
            "fp8_norm_fp32_tests",
            _pytest("tests/test_fp8_kernels.py", "-k", "in_fp32_under_every_config", "-v", stop_at_first=False),
            120,
            "rms_norm_fp8 in fp32 at 120 rows under every config of the norm's space (one warp at hidden 256, as the "
            "failing engine's table has it), and fp8_linear in fp32 at that engine's qkv and o shapes (o's K of 64 "
            "under BLOCK_K 128) under every config: suspects of fp8_moe_ops_check's failure",
        ),
        Step(
            "fp8_moe_engine_unfused",
            ["env", "PAGECAST_FUSE_ACT_QUANT_FP8=0", *_pytest("tests/test_fused_moe_fp8_gpu.py", "-k", "tuned_fp32", "-v")],
            240,
            "the failing tuned fp32 FP8-MoE engine test with the RMSNorm and the activation quantisation in "
            "launches of their own (ops.FUSE_ACT_QUANT_FP8 off): a review of the code found no GPU-only hazard in "
            "the MoE kernels and named the fused norm + quantise before qkv (added after the H200 pass at 9c55d4d; "
            "[120, 256] fp32 rows, one warp) as the likeliest culprit, o_proj's K of 64 under BLOCK_K 128 next",
        ),
        Step(
            "qwen3_w4",
            [*qwen3_w4, str(out / "new")],
            300,
            "issue 27's Qwen3-30B-A3B W4 on main (ONE_LAUNCH, slower at every decode bucket on an H100 in the "
            "thirtieth session, stays out of the space; last: 2.322x the active-weight roofline on the H200, "
            "target 2x)",
        ),
        Step(
            "fp8_w4",
            [PY, str(bench / "fp8.py"), "--out", str(out / "fp8w4"), "--variants", "bf16,fp8,fp8+fp8head", "--phases",
             "W4", "--tune-budget", "60"],
            420,
            "issue 29's FP8 W4 against bf16 (H100, thirtieth session: 0.646x with the tuner's feed_apart marks; "
            "target 0.62x), and with the LM head in FP8 too (--fp8-lm-head, asked for; built --tuning-from the fp8 "
            "artifact): on the H200 it took 0.129 ms off (0.693x -> 0.666x), which on the H100 would be about 0.62x",
        ),
        Step(
            "fp8_w4_fused",
            ["env", "PAGECAST_FEED_APART=0", PY, str(bench / "serving.py"), "--artifact", str(out / "fp8w4" / "llama3-8b-fp8"),
             "--phases", "W4", "--out", str(out / "fp8w4_fused")],
            90,
            "the same FP8 artifact's W4 with the tuner's feed_apart marks ignored (every decode norm and activation "
            "inside the fused GEMV, as before the marks): the same-run, same-artifact baseline of fp8_w4",
        ),
        Step(
            "fp8_w4_unfused",
            ["env", "PAGECAST_FUSE_ACT_QUANT_FP8=0", "PAGECAST_FUSE_NORM_DECODE=0", PY, str(bench / "serving.py"),
             "--artifact", str(out / "fp8w4" / "llama3-8b-fp8"), "--phases", "W4", "--out", str(out / "fp8w4_unfused")],
            90,
            "the same FP8 artifact's W4 with the norm and the activation in launches of their own: the same-run, "
            "same-artifact baseline of fp8_w4",
        ),
        Step(
            "fp8_w1_w6",
            [PY, str(bench / "fp8.py"), "--out", str(out / "fp8"), "--variants", "bf16,fp8", "--phases", "W4,W1,W6",
             "--tune-budget", "60"],
            450,
            "issue 29's FP8 W4, W1 and W6 against bf16 with the norm inside the decode GEMV (qkv, gate_up), "
            "down's activation inside it too, and past 16 rows in the launch that quantises (last: 0.701x, "
            "1.325x and 1.205x; targets 0.62x, 1.4x and 1.3x)",
        ),
        Step(
            "fp8_w1_w6_unfused",
            ["env", "PAGECAST_FUSE_ACT_QUANT_FP8=0", "PAGECAST_FUSE_NORM_DECODE=0", PY, str(bench / "serving.py"),
             "--artifact", str(out / "fp8" / "llama3-8b-fp8"), "--phases", "W4,W1,W6", "--out", str(out / "fp8_unfused")],
            200,
            "the same FP8 artifact served with both fusions off (the norm its own launch before the decode GEMV, "
            "the activation and the quantisation in two launches past 16 rows), as before: the same-run, "
            "same-artifact baseline of fp8_w1_w6",
        ),
        Step(
            "fp8_profile",
            [PY, str(bench / "profile_step.py"), "--artifact", str(out / "fp8" / "llama3-8b-fp8"), "--batch", "1",
             "--context", "128", "--steps", "16", "--top", "30"],
            120,
            "where FP8 W4's step goes now, kernel by kernel (thirteenth session: the skinny GEMV 2.32 ms in 128 "
            "launches, norms 0.14 ms in 65, the bf16 LM head 0.25 ms, attention 0.20 ms; 0.62x of bf16 is 2.89 ms)",
        ),
        Step(
            "fp8_block_speed",
            [PY, str(bench / "fp8.py"), "--out", str(out / "fp8b"), "--variants", "bf16,fp8block", "--phases",
             "W1,W6,W4", "--tune-budget", "60"],
            540,
            "the speed of --fp8-scheme block (never measured; +3.53% word perplexity on SmolLM2 against channel's "
            "+5.17%) against bf16, for the choice of FP8 format",
        ),
        Step(
            "qwen3_profile",
            [PY, str(bench / "profile_step.py"), "--artifact", str(out / "new" / "qwen3-30b-a3b-bf16"), "--batch", "1",
             "--context", "128", "--steps", "16", "--top", "40"],
            120,
            "where that W4 step goes, kernel by kernel (twenty-sixth session, H100: 16.3 us a MoE GEMV launch, two a "
            "layer; 9.7 qkv, 9.1 o, 7.2 router with its norm, 6.5 attention with its merge)",
        ),
        Step(
            "fusion_tests",
            _pytest("tests/test_kernels_gpu.py", "tests/test_moe_route_kernel_gpu.py", "tests/test_moe_families_gpu.py",
                    "-k", "merge or norm_inside or moe_fp32", "-vv"),
            240,
            "the in-launch decode merge (bf16, Llama-3-8B and SmolLM2 shapes) and the norm inside the fused router "
            "(bf16, every config, in a CUDA graph) against their references, and the fp32 MoE engines against "
            "transformers through ops.add_norm_moe, before any timing",
        ),
        Step(
            "qwen3_w4_pdl",
            ["env", "PAGECAST_PDL=1", *qwen3_w4[1:], str(out / "pdl")],
            300,
            "the same W4 with programmatic dependent launch (never measured on a MoE model: about 600 launches a step)",
        ),
        Step(
            "mixtral_profile",
            [PY, str(bench / "moe.py"), "--shapes", "mixtral-8x7b", "--tokens", "1024,4096", "--profile", "--out",
             str(out / "mixtral")],
            240,
            "why the fused MoE's summed kernel time beat the naive loop at Mixtral's 1,024 and 4,096 tokens (1,414 "
            "against 1,504 us; 4,340 against 4,503) while the benchmark's graph medians tied or lost (1,540 against "
            "1,540; 5,028 against 4,870): each path's fixed-routing graph time beside both",
        ),
        Step(
            "moe_quant_tests",
            _pytest("tests/test_fused_moe_fp8_gpu.py", "tests/test_fused_moe_w4a16_gpu.py", "-vv"),
            420,
            "the FP8 and int4 fused-MoE kernels against their references (H100, thirtieth session: 24 passed, "
            "the tuned fp32 FP8-MoE engine failed, the last int4 test cut off by the call's limit)",
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-queue-out"))
    ap.add_argument("--budget", type=float, default=570.0, help="seconds for the whole queue (a device call's limit, less a margin)")
    ap.add_argument("--from", dest="start", default="", help="skip the steps before this one")
    ap.add_argument("--only", default="", help="comma-separated steps to run (in queue order)")
    ap.add_argument("--fit", type=float, default=1.0,
                    help="start a step when this share of its timeout fits in what is left (it then gets what is left)")
    ap.add_argument("--list", action="store_true", help="print the steps and stop")
    args = ap.parse_args()
    queue = steps(args.out)
    names = [s.name for s in queue]
    for name in [args.start, *filter(None, args.only.split(","))]:
        if name and name not in names:
            sys.exit(f"no step {name!r}; the steps are {', '.join(names)}")
    if args.start:
        queue = queue[names.index(args.start) :]
    if args.only:
        wanted = set(args.only.split(","))
        queue = [s for s in queue if s.name in wanted]
    if args.list:
        for s in queue:
            print(f"{s.name:16} {s.timeout_s:4d} s  {s.decides}")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget
    for step in queue:
        left = deadline - time.monotonic()
        row: dict[str, object] = {"step": step.name, "command": step.command}
        if step.timeout_s * args.fit > left:
            row.update(skipped=f"its timeout ({step.timeout_s} s) does not fit the {left:.0f} s left; rerun with --from {step.name}")
            _record(args.out, row)
            break
        t0 = time.monotonic()
        with open(args.out / f"{step.name}.log", "w") as log:
            try:
                timeout = min(step.timeout_s, left)
                rc: int | None = subprocess.run(step.command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False).returncode
                timed_out = False
            except subprocess.TimeoutExpired:
                rc, timed_out = None, True
        row.update(rc=rc, timed_out=timed_out, seconds=round(time.monotonic() - t0, 1))
        _record(args.out, row)
    bundled = bundle(args.out)
    if bundled:
        _record(args.out, bundled)


def bundle(out: Path) -> dict[str, object]:
    """Pack what the steps wrote in ``out``'s folders (artifacts' report.md, tuning.json and
    model.py, benchmarks' jsonl) into out/BUNDLE and delete those folders: the device tool returns
    at most 8 files, so an artifact's own files would crowd out its tuning table. Left out: the
    Triton caches and files over KEEP_BYTES (weights). The queue's logs and queue.jsonl, directly
    in ``out``, stay. Returns what was packed and what was left out, relative to ``out``."""
    packed, left_out = [], []
    folders = sorted(p for p in out.iterdir() if p.is_dir())
    if not folders:
        return {}
    with tarfile.open(out / BUNDLE, "w:gz") as tar:
        for folder in folders:
            for f in sorted(folder.rglob("*")):
                if not f.is_file():
                    continue
                name = str(f.relative_to(out))
                if "triton_cache" in f.relative_to(out).parts or f.stat().st_size > KEEP_BYTES:
                    left_out.append(name)
                else:
                    tar.add(f, arcname=name)
                    packed.append(name)
    for folder in folders:
        shutil.rmtree(folder)
    return {"bundle": BUNDLE, "packed": packed, "left_out": left_out}


def _record(out: Path, row: dict[str, object]) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    with open(out / "queue.jsonl", "a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    main()
