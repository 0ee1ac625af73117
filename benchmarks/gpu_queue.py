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
When the queue ends, every Triton cache and every file over 64 MiB under OUT is deleted (listed
in queue.jsonl): the device tool returns only so many files, and a built artifact's cache would
crowd out its report.md and tuning.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PY = sys.executable
KEEP_BYTES = 64 << 20  # files under OUT larger than this are deleted when the queue ends


@dataclass(frozen=True)
class Step:
    name: str
    command: list[str]
    timeout_s: int
    decides: str


def _pytest(*args: str) -> list[str]:
    # pytest-timeout's thread method: a test that hangs on the GPU is named, with its stack, and ended
    return [PY, "-m", "pytest", "-m", "gpu", "-q", "-x", "-p", "no:cacheprovider", "--timeout", "120",
            "--timeout-method", "thread", *args]


def steps(out: Path) -> list[Step]:
    """The queue (``out``: where benchmarks that take --out write)."""
    bench = Path(__file__).parent
    return [
        Step(
            "qwen3_w4",
            ["env", "PAGECAST_TUNE_STALL_S=120", PY, str(bench / "families.py"), "--out", str(out), "--models",
             "qwen3-30b-a3b", "--phases", "W4", "--tune-budget", "120"],
            420,
            "issue 27's Qwen3-30B-A3B W4 against its roofline on an H200, with every lead in the tuner's space (3.749 ms, "
            "2.565x on the H200 before the leads; 3.982 ms, 1.964x on an H100 with them, twenty-fourth session)",
        ),
        Step(
            "qwen3_profile",
            [PY, str(bench / "profile_step.py"), "--artifact", str(out / "qwen3-30b-a3b-bf16"), "--batch", "1",
             "--context", "128", "--steps", "16", "--top", "40"],
            180,
            "where the W4 step of that artifact goes, kernel by kernel (the thirteenth session's profile: 3.4 ms of "
            "kernels in 3.75 ms), and so which decode leads its table kept",
        ),
        Step(
            "build_options_test",
            _pytest("tests/test_build_options_gpu.py"),
            240,
            "PDL: an artifact built with it serves the same bf16 greedy tokens, graphs on and off, and compiles "
            "nothing",
        ),
        Step(
            "kernel_tests",
            _pytest("tests/test_fused_moe_gpu.py", "-k", "grouped or configs_match"),
            240,
            "every fused_moe config (the DOT GEMV among them) and GROUPED against the reference in bf16 on sm_90: "
            "GROUPED joins the tuner's space only then (the first case ran past 120 s with the WS tiles, since removed)",
        ),
        Step(
            "mixtral_prefill",
            [PY, str(bench / "moe.py"), "--shapes", "mixtral-8x7b", "--tokens", "512,1024,4096", "--no-sweep",
             "--out", str(out / "mixtral")],
            240,
            "GROUPED against the default tile and the naive loop at Mixtral's prefill buckets (fused/naive 0.95x at "
            "4,096: the best tile 552.5 TFLOP/s, cuBLAS 583.6, sixteenth session)",
        ),
        Step(
            "grouped_qwen3",
            [PY, str(bench / "moe.py"), "--shapes", "qwen3-30b-a3b", "--tokens", "16,256,1024,4096", "--no-sweep",
             "--out", str(out / "qwen3")],
            240,
            "GROUPED against the default tile and the naive loop at Qwen3-30B-A3B's buckets",
        ),
        Step(
            "fp8_tests",
            _pytest("tests/test_fp8_gpu.py"),
            300,
            "the FP8 engine test: a divergence allowed where the reference's gap is under twice the prompts' largest "
            "logit move (failed on the H100 in the twenty-fourth session at a 0.18 gap with a fixed 0.1)",
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
    trimmed = trim(args.out)
    if trimmed:
        _record(args.out, {"trimmed": trimmed})


def trim(out: Path) -> list[str]:
    """Delete the Triton caches and the files over KEEP_BYTES in ``out``'s folders (the queue's own
    logs, directly in ``out``, stay); returns what went, relative to ``out``."""
    gone = []
    for cache in sorted(out.rglob("triton_cache")):
        if cache.is_dir():
            shutil.rmtree(cache)
            gone.append(str(cache.relative_to(out)) + "/")
    for f in sorted(out.rglob("*")):
        if f.parent != out and f.is_file() and f.stat().st_size > KEEP_BYTES:
            f.unlink()
            gone.append(str(f.relative_to(out)))
    return gone


def _record(out: Path, row: dict[str, object]) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    with open(out / "queue.jsonl", "a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    main()
