"""Pass 7, pack: write the weights per rank (renamed, fused, cast), the tokenizer and the plans.

Weights stream one tensor at a time from the checkpoint into weights/rank{r}.safetensors,
each rank's file holding only its slices (builder.shard cuts them). With --load-format dummy
no weight file is written: the manifest marks the weights random and the runtime draws them
(seeded) at load, so a 70B-shaped benchmark artifact fits any disk; dummy int4 (--quant) weights
are the exception, drawn here in the packed layout the kernels read.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from pagecast.builder import quant, shard
from pagecast.builder.ir import BuildState, TensorPlan
from pagecast.builder.safetensors_writer import StreamingSafetensorsWriter
from pagecast.runtime.errors import BuildError

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
STORED_DTYPES = {**TORCH_DTYPES, "int32": torch.int32, "int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}  # int4 / fp8 parts


def _random(t: TensorPlan, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if t.name.endswith("norm.weight"):
        return torch.ones(t.shape, dtype=dtype)
    # Drawn on the GPU when there is one: billions of random numbers take minutes on a CPU.
    return (torch.randn(t.shape, generator=gen, dtype=torch.float32, device=gen.device) * 0.02).to(dtype).cpu()


def write_weights(state: BuildState, out_dir: Path) -> None:
    """Every rank's weights/rank{r}.safetensors, written side by side: tensor i of every rank,
    then tensor i + 1 (each rank's plan lists the same names in the same order), so an int4
    projection is repacked once and handed to all ranks (quant.Materialiser)."""
    plan = state.plan
    assert plan is not None
    dtype = TORCH_DTYPES[plan.dtype]
    if state.checkpoint.dummy and plan.quantization is None:
        state.checkpoint.close()  # random weights are drawn by the runtime (manifest layout.weights)
        return
    gen = None
    if state.checkpoint.dummy:  # int4 dummy weights are drawn here, in the artifact's packed layout
        gen = torch.Generator("cuda" if torch.cuda.is_available() else "cpu").manual_seed(state.options.seed)
    (out_dir / "weights").mkdir(parents=True, exist_ok=True)
    ranks = [[t for t in plan.tensors if t.rank == rank] for rank in range(plan.tp)]
    if any([t.name for t in r] != [t.name for t in ranks[0]] for r in ranks):
        raise BuildError("internal: the ranks' tensor plans differ")
    int4 = None
    if plan.quantization is not None:
        int4 = quant.Materialiser(plan.quantization, state.checkpoint.tensor, plan.dtype, gen, state.model)
    with contextlib.ExitStack() as stack:
        writers = [
            stack.enter_context(
                StreamingSafetensorsWriter(
                    out_dir / "weights" / f"rank{rank}.safetensors",
                    [(t.name, t.shape, STORED_DTYPES[t.dtype] if t.dtype else dtype) for t in tensors],
                )
            )
            for rank, tensors in enumerate(ranks)
        ]
        label = "packing weights" + (f" ({plan.tp} ranks)" if plan.tp > 1 else "")
        for i in _progress(list(range(len(ranks[0]))), state.options.quiet, label):
            for writer, tensors in zip(writers, ranks, strict=True):
                t = tensors[i]
                if int4 is not None and int4.handles(t):
                    writer.write(t.name, int4(t))
                elif gen is not None:
                    writer.write(t.name, _random(t, dtype, gen))
                else:
                    writer.write(t.name, shard.rank_tensor(state.checkpoint.tensor, t, dtype))
    state.checkpoint.close()


def _progress(items: list[int], quiet: bool, description: str):  # type: ignore[no-untyped-def]
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
    processor_template = state.checkpoint.path / "chat_template.json"
    if getattr(tokenizer, "chat_template", None) is None and processor_template.is_file():
        # An image-text checkpoint may keep its chat template with its processor's files only
        # (chat_template.json), which the tokenizer does not read: the artifact's tokenizer takes it.
        try:
            tokenizer.chat_template = json.loads(processor_template.read_text())["chat_template"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise BuildError(f"{processor_template} holds no chat template ({e!r}); fix or delete it") from e
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
