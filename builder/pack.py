"""Pass 7, pack: write the weights per rank (renamed, fused, cast), the tokenizer and the plans.

Weights stream one tensor at a time from the checkpoint into weights/rank{r}.safetensors.
With --load-format dummy they are random (seeded), for benchmarks where values do not
matter.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pagecast.builder import quant
from pagecast.builder.ir import BuildState, TensorPlan
from pagecast.builder.safetensors_writer import StreamingSafetensorsWriter
from pagecast.runtime.errors import BuildError

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
STORED_DTYPES = {**TORCH_DTYPES, "int32": torch.int32, "int8": torch.int8}  # int4 parts (builder/quant.py)


def _materialise(state: BuildState, t: TensorPlan, dtype: torch.dtype, gen: torch.Generator | None) -> torch.Tensor:
    if gen is not None:
        if t.name.endswith("norm.weight"):
            return torch.ones(t.shape, dtype=dtype)
        # Drawn on the GPU when there is one: 8B random numbers take minutes on a CPU.
        return (torch.randn(t.shape, generator=gen, dtype=torch.float32, device=gen.device) * 0.02).to(dtype).cpu()
    parts = [state.checkpoint.tensor(src) for src in t.sources]
    tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    if not torch.isfinite(tensor).all():
        raise BuildError(f"checkpoint tensor(s) {', '.join(t.sources)} contain NaN or inf; the checkpoint is corrupt")
    return tensor.to(dtype)


def write_weights(state: BuildState, out_dir: Path) -> None:
    plan = state.plan
    assert plan is not None
    dtype = TORCH_DTYPES[plan.dtype]
    gen = None
    if state.checkpoint.dummy:
        gen = torch.Generator("cuda" if torch.cuda.is_available() else "cpu").manual_seed(state.options.seed)
    (out_dir / "weights").mkdir(parents=True, exist_ok=True)
    for rank in range(plan.tp):
        tensors = [t for t in plan.tensors if t.rank == rank]
        layout = [(t.name, t.shape, STORED_DTYPES[t.dtype] if t.dtype else dtype) for t in tensors]
        int4 = None
        if plan.quantization is not None:
            int4 = quant.Materialiser(plan.quantization, state.checkpoint.tensor, plan.dtype, gen)
        with StreamingSafetensorsWriter(out_dir / "weights" / f"rank{rank}.safetensors", layout) as writer:
            for t in _progress(tensors, state.options.quiet, f"packing weights (rank {rank})"):
                if int4 is not None and quant.is_quant_part(t):
                    writer.write(t.name, int4(t))
                    continue
                writer.write(t.name, _materialise(state, t, dtype, gen))
    state.checkpoint.close()


def _progress(items: list[TensorPlan], quiet: bool, description: str):  # type: ignore[no-untyped-def]
    if quiet:
        return items
    from rich.progress import track

    return track(items, description=description, transient=True)


def write_tokenizer(state: BuildState, out_dir: Path) -> bool:
    if not state.checkpoint.has_tokenizer:
        return False
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(state.checkpoint.path))
    except Exception as e:  # tokenizer loading raises many error types
        raise BuildError(f"cannot load the tokenizer from {state.checkpoint.path}: {e}") from e
    tokenizer.save_pretrained(str(out_dir / "tokenizer"))
    return True


def run(state: BuildState) -> BuildState:
    out = state.staging_dir
    assert out is not None and state.plan is not None and state.model_py is not None
    (out / "model.py").write_text(state.model_py)
    write_weights(state, out)
    has_tokenizer = write_tokenizer(state, out)
    (out / "tuning.json").write_text(json.dumps(state.tuning, indent=2, sort_keys=True))
    (out / "memory_plan.json").write_text(json.dumps(state.plan.memory, indent=2))
    report = dict(state.report, has_tokenizer=has_tokenizer)
    import dataclasses

    return dataclasses.replace(state, report=report)
