"""What benchmarks/kvcache.py and benchmarks/quant.py share: build variants of the
Llama-3-8B-shaped dummy engine that differ in one build option, measure each with
benchmarks/serving.py's phases in a fresh process (one engine holds most of the GPU's memory),
and record every figure as a JSON line (printed and appended to OUTDIR/NAME.jsonl)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from serving import LLAMA3_8B


class Recorder:
    """Figures as JSON lines: printed and appended to ``out / name``."""

    def __init__(self, out: Path, name: str):
        self.path = out / name

    def __call__(self, **row: object) -> dict[str, object]:
        line = json.dumps(row)
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")
        return row

    def machine(self) -> None:
        import torch

        self(figure="machine", value=torch.cuda.get_device_name(0), torch=torch.__version__,
             date=time.strftime("%Y-%m-%d"), commit=os.environ.get("PAGECAST_COMMIT", "unknown"))  # fmt: skip


def chosen_variants(names: str, known: dict[str, Any]) -> list[str]:
    variants = [v for v in names.split(",") if v]
    unknown = [v for v in variants if v not in known]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {sorted(known)}")
    return variants


def build(out: Path, artifact: Path, variant: str, record: Recorder, max_model_len: int, tune_budget: float,
          config: dict[str, Any] | None = None, **options: Any) -> Path:  # fmt: skip
    """The variant's artifact (built once; an existing one is reused) of ``config`` (default
    Llama-3-8B): random weights (``--load-format dummy``), this GPU, ``options`` on top (``gpu``
    among them: "cpu" for a dry run)."""
    from pagecast.builder.ir import BuildOptions
    from pagecast.builder.pipeline import build as run_build

    if (artifact / "manifest.json").is_file():
        record_cut_off(artifact, variant, record)
        return artifact
    # Llama-3-8B's keeps its old name (existing runs reuse it); another config's is named after its artifact.
    cfg_dir = out / ("llama3-8b-config" if config is None else f"{artifact.name}-config")
    cfg_dir.mkdir(parents=True, exist_ok=True)
    (cfg_dir / "config.json").write_text(json.dumps(config or LLAMA3_8B))
    start = time.perf_counter()
    run_build(
        BuildOptions(**{"model": str(cfg_dir), "output": artifact, "gpu": "auto", "load_format": "dummy",
                        "max_model_len": max_model_len, "tune_budget_s": tune_budget, "force": True, "quiet": True,
                        "max_num_seqs": 1024, **options}),
        log=lambda line: print(f"  build {variant}", line, flush=True),
    )  # fmt: skip
    record(variant=variant, figure="enginebuild_seconds", value=round(time.perf_counter() - start, 1))
    record_cut_off(artifact, variant, record)
    return artifact


def cut_off_buckets(artifact: Path) -> dict[str, int]:
    """Per kernel, the buckets of the artifact's tuning table that the build's tuning budget cut
    off (``budget_spent``: the launcher's default or a neighbour's winner, not tuned there)."""
    table_path = artifact / "tuning.json"
    if not table_path.is_file():
        return {}
    kernels = json.loads(table_path.read_text()).get("kernels", {})
    counts = {name: sum(bool(e.get("budget_spent")) for e in entries.values())
              for name, entries in kernels.items()}  # fmt: skip
    return {name: n for name, n in counts.items() if n}


def record_cut_off(artifact: Path, variant: str, record: Recorder) -> None:
    """A ``tuning_cut_off`` row: a figure measured on kernels the budget left untuned says so
    (every Qwen3-30B-A3B W4 before 2026-12-03 ran untuned experts at --tune-budget 20)."""
    cut = cut_off_buckets(artifact)
    record(variant=variant, figure="tuning_cut_off", value=sum(cut.values()), buckets=cut)
    if cut:
        print(f"  {variant}: the tuning budget cut off {sum(cut.values())} buckets: {cut}", flush=True)


def measure(out: Path, variant: str, artifact: Path, phases: set[str], record: Recorder,
            setup: str = "", **ours: Any) -> list[dict[str, object]]:  # fmt: skip
    """serving.py's ``phases`` on this artifact, in a fresh process (``setup``: Python run there
    first; ``ours``: phase_ours's keyword arguments); its JSON lines, recorded with the variant's
    name (an ``engine_failed`` row when the process failed)."""
    vdir = out / variant
    vdir.mkdir(parents=True, exist_ok=True)
    (vdir / "serving.jsonl").unlink(missing_ok=True)
    code = (
        f"{setup}\nimport sys; from pathlib import Path; sys.path.insert(0, 'benchmarks'); import serving; "
        f"serving.phase_ours(Path({str(vdir)!r}), Path({str(artifact)!r}), set({sorted(phases)!r}), **{ours!r})"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=Path(__file__).parent.parent)
    rows = []
    if (vdir / "serving.jsonl").is_file():
        rows = [json.loads(line) for line in (vdir / "serving.jsonl").read_text().splitlines() if line.strip()]
    if proc.returncode != 0:
        rows.append({"figure": "engine_failed", "value": f"exit {proc.returncode}"})
    return [record(variant=variant, **r) for r in rows]
