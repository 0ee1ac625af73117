"""Pass 5, tune: pick each kernel's launch config for this GPU, block size and model shape.

On the target GPU the kernels' config spaces are timed (pagecast.kernels.tuning) with the
Triton cache pointed into the artifact, so the compiled kernels ship with it and serving
compiles nothing. Without the target GPU the shipped default table for that GPU is used and
the artifact is marked untuned. CPU artifacts run the torch reference and need no table.
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from pagecast.builder.ir import BuildState

TRITON_CACHE_SUBDIR = "triton_cache"


@contextmanager
def triton_cache_at(path: Path) -> Iterator[None]:
    previous = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(path)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = previous


def model_shapes(state: BuildState) -> dict[str, Any]:
    model, plan = state.model, state.plan
    assert model is not None and plan is not None
    a = model.attention
    return {
        "num_heads": a.num_heads,
        "num_kv_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "hidden": model.hidden_size,
        "intermediate": model.mlp.intermediate_size,
        "block_size": plan.block_size,
        "dtype": plan.dtype,
        "max_model_len": plan.max_model_len,
        "max_num_seqs": plan.max_num_seqs,
    }


def run(state: BuildState) -> BuildState:
    plan = state.plan
    assert plan is not None and state.staging_dir is not None
    report = dict(state.report)
    if plan.device == "cpu":
        table: dict[str, Any] = {"device": "cpu", "tuned": False, "kernels": {}}
        report["tuning_note"] = "CPU artifact: the torch reference kernels run; nothing to tune"
        return dataclasses.replace(state, tuning=table, report=report)

    from pagecast.kernels import tuning

    shapes = tuning.ModelShapes(**model_shapes(state))
    if report.get("gpu_present"):
        with triton_cache_at(state.staging_dir / TRITON_CACHE_SUBDIR):
            table = tuning.tune(tuning.KERNELS, shapes, budget_s=state.options.tune_budget_s, device="cuda")
        copy_gbs = tuning.measure_copy_bandwidth("cuda")
        table["copy_bandwidth_gbs"] = round(copy_gbs, 1)
        report["bandwidth_rows"] = tuning.bandwidth_report(table, shapes, copy_gbs)
        report["tuning_note"] = (
            f"tuned on this {plan.gpu_name} within {state.options.tune_budget_s:.0f} s; "
            f"measured copy bandwidth {copy_gbs:,.0f} GB/s"
        )
    else:
        table = tuning.default_table(plan.gpu_name) or {"device": plan.gpu_name, "tuned": False, "kernels": {}}
        table = dict(table, tuned=False)
        report["tuning_note"] = (
            f"no {plan.gpu_name} present: the shipped default table for {plan.gpu_name} is used "
            f"(artifact marked untuned; rebuild on the GPU to tune)"
        )
    return dataclasses.replace(state, tuning=table, report=report)
