"""The GPU measurements still owed, in the order they are worth device time, run one after another
within one device call's limit: each step under its own timeout (a step that hangs costs its
timeout, not the call), its output in OUT/<step>.log, a JSON line per step in OUT/queue.jsonl
(rc, seconds, whether it timed out). A step starts only if its timeout fits in what is left of
``--budget``; ``--from`` resumes at a step in the next call. A step that serves an earlier step's
artifact (``--artifact`` in its command) needs that step in the same call: the machine may be a
fresh one, and the queue's folders are bundled and deleted when it ends. Without the artifact the
step is skipped, saying so, and the queue goes on.

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
import itertools
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


def _profile_run(artifact: Path, batch: int, context: int, output: int) -> list[str]:
    """profile_step.py's whole-workload mode: device time by kernel class, GPU idle, GEMM TFLOP/s."""
    return [PY, str(Path(__file__).parent / "profile_step.py"), "--artifact", str(artifact), "--mode", "run",
            "--batch", str(batch), "--context", str(context), "--output", str(output), "--top", "25"]


def steps(out: Path) -> list[Step]:
    """The queue (``out``: where benchmarks that take --out write)."""
    bench = Path(__file__).parent
    qwen3_w4 = ["env", "PAGECAST_TUNE_STALL_S=120", PY, "benchmarks/families.py", "--models", "qwen3-30b-a3b",
                "--phases", "W4", "--tune-budget", "120", "--out"]  # fmt: skip
    return [
        Step(
            "fp8_fast_accum_tests",
            _pytest("tests/test_fp8_kernels.py", "-k", "matches_the_reference_for_every_config or agrees_with_torch_scaled_mm "
                    "or fp8_linear_is_capture_safe", stop_at_first=False),
            240,
            "the forty-second session's fast accumulation (torch._scaled_mm's use_fast_accum, the untuned choice from 64 "
            "rows since 9e827f3) against the FP8 GEMM reference at the tolerance derived from its H100 measurement; "
            "17 passed on an H100 (forty-fourth session), still owed on an H200",
        ),
        Step(
            "fp8_fast_accum_ratio",
            [PY, str(bench / "fp8.py"), "--out", str(out / "fpfast"), "--variants", "bf16,fp8", "--phases", "W1,W6",
             "--tune-budget", "60"],
            450,
            "issue 29's FP8 W1 and W6 against bf16 with fast accumulation the default (targets 1.4x and 1.3x; the H200's "
            "last 1.361x and 1.216x before it; on an H100 it added 6.2% to FP8 W1 and 3.6% to W6 on one artifact)",
        ),
        Step(
            "llama4_gpu",
            _pytest("tests/test_kernels_chunked_gpu.py", "tests/test_moe_families_gpu.py", "-k", "chunked or llama4",
                    stop_at_first=False),
            240,
            "the fortieth session's Llama 4: chunked attention in both kernels in bf16 against the reference, and "
            "a tiny fp32 Llama 4 engine tuned on the GPU (chunked layers, the attention temperature, top-1 sigmoid "
            "routing on the experts' input, CUDA graphs) against transformers; passed on an H100 (fortieth session)",
        ),
        Step(
            "query_temperature_gpu",
            _pytest("tests/test_families_gpu.py", "tests/test_moe_families_gpu.py", "-k", "ministral3 or llama4",
                    stop_at_first=False),
            240,
            "the forty-first session's query temperature as a per-position table gathered in the model code: "
            "Ministral 3 (llama_4_scaling after YaRN RoPE, every layer) and Llama 4 (its no-RoPE layers) in fp32 "
            "engines tuned on the GPU, with CUDA graphs, against transformers; 2 passed on an H100 (forty-fourth session)",
        ),
        Step(
            "llama4_scout",
            [PY, str(bench / "families.py"), "--out", str(out / "llama4"), "--models", "llama4-scout-8l", "--phases",
             "W4,W1", "--tune-budget", "60"],
            300,
            "a Llama-4-Scout-shaped engine (8 of 48 layers, bf16): W4 against its active-weight roofline and W1; on "
            "an H100 (fortieth session) 1.262x and 21,330 tok/s with 2 Triton compiles at start, which b13dc15 "
            "should remove (the rotary kernel's QK_NORM_AFTER and plain variants): engine_init_seconds names any",
        ),
        Step(
            "spec_draft_tests",
            _pytest("tests/test_spec_draft_gpu.py", "-vv", stop_at_first=False),
            240,
            "the nested-draft speculation test with its near-tie criterion (fp32 token for token, bf16 parting only "
            "at a near-tie): its bf16 case, then compared token for token, failed on an H100 in the thirty-sixth "
            "session (on 3d16859, whose bf16 logits hold the same values as the fp32 copy before); never run in its "
            "new form",
        ),
        Step(
            "new_families_gpu",
            _pytest("tests/test_families_gpu.py", "-k",
                    "gemma] or olmo3 or exaone4 or glm or helium or ernie4_5 or seed_oss or hunyuan", stop_at_first=False),
            300,
            "the families added in the thirty-seventh session (Gemma 1, OLMo 3, EXAONE 4.0, GLM, GLM-4, Helium, "
            "ERNIE 4.5, Seed-OSS) and the thirty-eighth's HunYuan dense in fp32 on the GPU against transformers: "
            "Triton kernels (partial rotary on reordered q/k rows, windows from layer_types, no-RoPE layers, q/k norms "
            "on the rotated heads) and CUDA graphs; CPU parity only so far",
        ),
        Step(
            "new_moe_families_gpu",
            _pytest("tests/test_moe_families_gpu.py", "-k",
                    "minimax_m2 or dots1 or exaone_moe or solar_open or ernie4_5_moe or hunyuan_moe", stop_at_first=False),
            300,
            "the thirty-eighth session's MoE families (MiniMax-M2, dots1, EXAONE-MoE, Solar Open, ERNIE 4.5 MoE, "
            "HunYuan MoE) in fp32 on the GPU against transformers: their routings (sigmoid with groups or a score "
            "bias, softmax with a score bias, fp32 logits) in the decode graphs beside the fused-MoE kernels; CPU "
            "parity only so far",
        ),
        Step(
            "qwen3_w4",
            [*qwen3_w4, str(out / "new")],
            300,
            "issue 27's Qwen3-30B-A3B W4 on main, for an H200 (the target's GPU): 3.345 ms, 2.334x the "
            "active-weight roofline there in the thirty-fifth session (2.322x in the twenty-fifth), target 2x; an H100 "
            "gave 3.869 ms, 1.922x of its own roofline, in the thirty-second session",
        ),
        Step(
            "fp8_w4",
            [PY, str(bench / "fp8.py"), "--out", str(out / "fp8w4"), "--variants", "bf16,fp8,fp8+fp8head", "--phases",
             "W4", "--tune-budget", "60"],
            420,
            "issue 29's FP8 W4 against bf16, and with the LM head in FP8 too (--fp8-lm-head, asked for; built "
            "--tuning-from the fp8 artifact): an H100 in the thirty-sixth session 0.638x and 0.611x (0.651x and "
            "0.626x in the thirty-second; target 0.62x); the H200's last 0.693x and 0.666x",
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
            "issue 29's FP8 W4, W1 and W6 against bf16 (targets 0.62x, 1.4x and 1.3x): an H100 in the thirty-second "
            "session 0.650x, 1.307x and 1.291x; the H200's last 0.696x, 1.361x and 1.216x (thirty-fifth session)",
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
            "bf16_w1_w6",
            [PY, str(bench / "serving.py"), "--out", str(out / "bf16"), "--phases", "W1,W6", "--tune-budget", "60"],
            330,
            "issue 33's bf16 W1 and W6 on main at the benchmark's token budget of 8,192 a step (targets 11,500 and "
            "24,000; the H200's last 10,817-10,843 and 20,113-20,152 in three runs, thirty-fifth session; 11,214 and "
            "21,131 in the twenty-third; before 3d16859 kept the logits bf16, +0.31% W1 and +0.65% W6 on an H100): the "
            "baseline of bf16_w1_w6_16k",
        ),
        Step(
            "bf16_w1_w6_16k",
            [PY, str(bench / "serving.py"), "--artifact", str(out / "bf16" / "llama3-8b-dummy"), "--out",
             str(out / "bf16_16k"), "--phases", "W1,W6", "--max-num-batched-tokens", "16384"],
            150,
            "the same artifact with 16,384 tokens a step (vLLM's offline default on this class of GPU): half as many "
            "prefill steps, and larger prefill GEMMs (thirty-fifth session: W1 +0.3% and +0.1%, W6 -0.2%: no gain)",
        ),
        Step(
            "bf16_w1_profile",
            _profile_run(out / "bf16" / "llama3-8b-dummy", 1024, 512, 256),
            200,
            "where bf16 W1's time goes now, by kernel class (thirty-fifth session, 10,805 tok/s: GEMMs 16.82 s at 668 "
            "TFLOP/s, decode attention 5.45, prefill attention 0.50, elementwise 1.09, GPU idle 0.19 of 24.26 s); "
            "11,500 is 22.8 s",
        ),
        Step(
            "bf16_w6_profile",
            _profile_run(out / "bf16" / "llama3-8b-dummy", 512, 128, 1024),
            200,
            "where bf16 W6's time goes, by kernel class (thirty-fifth session, 20,044 tok/s: decode attention 11.14 s, "
            "92.6% of copy; GEMMs 13.38 s at 656 TFLOP/s; elementwise 0.93, the fp32 logits copy and argmax 0.32, GPU "
            "idle 0.25 of 26.16 s; the copy is gone since 3d16859, the argmax reads bf16)",
        ),
        Step(
            "fp8_w1",
            [PY, str(bench / "fp8.py"), "--out", str(out / "fp8p"), "--variants", "fp8", "--phases", "W1",
             "--tune-budget", "60"],
            300,
            "the FP8 artifact fp8_w1_profile profiles, and its W1 (no baseline in this step: fp8_w1_w6 has it)",
        ),
        Step(
            "fp8_w1_profile",
            _profile_run(out / "fp8p" / "llama3-8b-fp8", 1024, 512, 256),
            200,
            "where FP8 W1's time goes, by kernel class (GEMM TFLOP/s against the workload's FLOPs, attention, the "
            "quantising launches, GPU idle): FP8 W1 is 68.5% of its serial bound against bf16's 81.4% (sixth "
            "session), so it has the most room of issue 29's ratios (1.325x, target 1.4x)",
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
            "transformers through ops.add_norm_moe, before any timing (9 passed on an H100, thirty-second session)",
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
            "moe_fp8_tests",
            _pytest("tests/test_fused_moe_fp8_gpu.py", "-vv"),
            420,
            "the FP8 fused-MoE kernels against their references, and the tuned fp32 FP8-MoE engine (all 25 passed on "
            "an H100 in the thirty-fourth session, on d7f7020's tree: the activation quantisation shared with the dense "
            "path)",
        ),
        Step(
            "moe_fp8_speed",
            [PY, str(bench / "moe.py"), "--shapes", "qwen3-30b-a3b", "--fp8", "channel", "--tokens", "1,16,256",
             "--out", str(out / "moefp8")],
            300,
            "the FP8 fused MoE's speed against the per-expert loop of the dense FP8 GEMM at Qwen3-30B-A3B's decode "
            "buckets, never timed: on an H200 in the thirty-fifth session every FP8 config was refused by the bf16 "
            "agreement check (1.47-1.83% from the loop, all configs alike); moe.py now holds FP8 to the GPU tests' 2.5%",
        ),
        Step(
            "moe_int4_tests",
            _pytest("tests/test_fused_moe_w4a16_gpu.py", "-vv"),
            300,
            "the int4 fused-MoE kernels against their references and the int4 MoE engines (its file's tests were cut "
            "by the call's limit in the thirtieth and thirty-fourth sessions, when they ran after the FP8 file)",
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
        missing = _missing_artifact(step)
        if missing is not None:
            row.update(skipped=f"it serves {missing}, which an earlier step builds: run that step in the same call")
            _record(args.out, row)
            continue
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
        _record(args.out, bundled, echo={**bundled, "packed": len(bundled["packed"]), "left_out": len(bundled["left_out"])})


def _missing_artifact(step: Step) -> str | None:
    """The artifact ``step`` serves (the path after ``--artifact``) when it does not exist, else None."""
    args = step.command
    for flag, value in itertools.pairwise(args):
        if flag == "--artifact" and not Path(value).exists():
            return value
    return None


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


def _record(out: Path, row: dict[str, object], echo: dict[str, object] | None = None) -> None:
    """Append ``row`` to queue.jsonl and print it (or ``echo``, a shorter form: the device tool
    returns only the output's tail, which the bundle's file lists would fill)."""
    print(json.dumps(row if echo is None else echo), flush=True)
    with open(out / "queue.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
