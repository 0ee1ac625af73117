"""Pass 7b, speculative: put the drafter enginebuild --speculative-config names into the artifact.

The artifact then serves with speculative decoding by default (the manifest's ``speculative``
entry, which LLM / engine-serve use when given no speculative_config), and stays
self-contained: whatever the drafter needs lies under ``speculative/`` and is listed and hashed
by the manifest like every other file (emit hashes the whole staging tree afterwards).

- ``ngram``: nothing to build; only the config is recorded.
- ``draft_model``: ``model`` is a Hugging Face checkpoint, built here into a nested artifact with
  the target's options (device, block size, dtype, max_model_len, KV-cache dtype, load format,
  max_num_seqs: its own weights, memory plan and tuned kernels), or an existing pagecast
  artifact, verified and copied after checking that it pairs with the target.
- ``eagle3``: ``model`` is a directory of EAGLE-3 head weights, converted by builder/eagle3.py.

Either way the draft must share the target's vocabulary and tokenizer and its block size (its
KV cache is indexed by the target's block tables), and run on the same device: checked here so
that a mismatch fails the build, not the first start.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from pagecast.builder.ir import BuildOptions, BuildState
from pagecast.runtime.artifact import (
    MANIFEST,
    SPECULATIVE_DIR,
    Manifest,
    check_no_unlisted_files,
    load_manifest,
    sha256_file,
    verify_files,
)
from pagecast.runtime.errors import ArtifactError, BuildError

TOKENIZER_FILE = "tokenizer/tokenizer.json"


def run(state: BuildState) -> BuildState:
    config = state.options.speculative_config
    if config is None:
        return state
    staging = state.staging_dir
    assert staging is not None and state.plan is not None
    method = config["method"]
    entry = dict(config)
    if method == "draft_model":
        add_draft_model(state, Path(config["model"]), staging / SPECULATIVE_DIR)
        entry["model"] = SPECULATIVE_DIR
    elif method == "eagle3":
        add_eagle3_head(state, Path(config["model"]), staging / SPECULATIVE_DIR)
        entry["model"] = SPECULATIVE_DIR
    report = dict(state.report)
    report.setdefault("plan_notes", [])
    report["plan_notes"] = [*report["plan_notes"], f"speculative decoding by default: {entry}"]
    return dataclasses.replace(state, speculative=entry, report=report)


def add_draft_model(state: BuildState, source: Path, dst: Path) -> None:
    """Build (a checkpoint) or copy (an artifact) the draft model into ``dst``, then check it
    pairs with the target."""
    assert state.plan is not None
    if state.plan.tp > 1:
        raise BuildError(
            "speculative_config draft_model: speculative decoding with a draft model is not supported yet "
            f"with tensor parallelism (this build has --tp {state.plan.tp}); build with --tp 1 or use method ngram"
        )
    if (source / MANIFEST).is_file():
        copy_draft_artifact(source, dst)
    else:
        build_draft(state, source, dst)
    check_draft_manifest(state, load_manifest(dst), str(source))


def build_draft(state: BuildState, source: Path, dst: Path) -> None:
    """Build the draft checkpoint ``source`` into ``dst`` with the target's options (its dtype
    and max_model_len as resolved by the plan, so the draft covers every position the target serves)."""
    from pagecast.builder.pipeline import build

    plan, opts = state.plan, state.options
    assert plan is not None
    draft_options = BuildOptions(
        model=str(source),
        output=dst,
        gpu=opts.gpu,
        block_size=plan.block_size,
        dtype=plan.dtype,
        max_model_len=plan.max_model_len,
        tp=1,
        load_format=opts.load_format,
        max_num_seqs=opts.max_num_seqs,
        tune_budget_s=opts.tune_budget_s,
        tune_first=opts.tune_first,
        kv_cache_dtype=opts.kv_cache_dtype,
        force=True,
        quiet=True,
        seed=opts.seed,
    )
    try:
        build(draft_options)
    except BuildError as e:
        raise BuildError(f"speculative_config draft_model {source}: building the draft failed: {e}") from e


def copy_draft_artifact(source: Path, dst: Path) -> None:
    """Copy a draft artifact after checking it is whole and unchanged (the copy is hashed anew by
    this build's manifest, so a corrupted draft must be caught before it)."""
    try:
        manifest = load_manifest(source)
        check_no_unlisted_files(source, manifest)
        verify_files(source, manifest)
    except ArtifactError as e:
        raise BuildError(f"speculative_config draft_model: {e}") from e
    shutil.copytree(source, dst)


def check_draft_manifest(state: BuildState, draft: Manifest, source: str) -> None:
    """The draft pairs with the target: same vocabulary and tokenizer, same block size, same
    device target, one rank, and a context at least the target's."""
    plan, model, staging = state.plan, state.model, state.staging_dir
    assert plan is not None and model is not None and staging is not None
    where = f"speculative_config draft_model {source}"
    if int(draft.dims["vocab_size"]) != model.vocab_size:
        raise BuildError(
            f"{where}: its vocabulary has {draft.dims['vocab_size']} tokens and the target's {model.vocab_size}; "
            "a draft must share the target's tokenizer and vocabulary: pick a smaller model of the same family"
        )
    ours = staging / TOKENIZER_FILE
    theirs = draft.files.get(TOKENIZER_FILE)
    if ours.is_file() and theirs is not None and sha256_file(ours) != theirs:
        raise BuildError(
            f"{where}: its tokenizer (tokenizer.json) differs from the target's; a draft must use the same "
            "tokenizer, token for token: pick a smaller model of the same family"
        )
    if draft.block_size != plan.block_size:
        raise BuildError(
            f"{where}: it was built with --block-size {draft.block_size} and this build has "
            f"--block-size {plan.block_size}; rebuild the draft with --block-size {plan.block_size} "
            "(or give its checkpoint, which is then built with this build's options)"
        )
    mine = (plan.device, plan.gpu_name, tuple(plan.compute_capability) if plan.compute_capability else None)
    target = draft.target
    theirs_device = (target.kind, target.name, tuple(target.compute_capability) if target.compute_capability else None)
    if mine != theirs_device:
        raise BuildError(
            f"{where}: it was built for {target.name} ({target.kind}) and this build is for {plan.gpu_name} "
            f"({plan.device}); rebuild the draft with --gpu {plan.gpu_name} (or give its checkpoint)"
        )
    if draft.tp != 1:
        raise BuildError(f"{where}: it was built with --tp {draft.tp}; a draft model must be built with --tp 1")
    if draft.max_model_len < plan.max_model_len:
        raise BuildError(
            f"{where}: its max_model_len {draft.max_model_len} is shorter than the target's {plan.max_model_len}; "
            f"rebuild the draft with --max-model-len {plan.max_model_len} (or give its checkpoint)"
        )


def add_eagle3_head(state: BuildState, source: Path, dst: Path) -> None:
    """Convert an EAGLE-3 head (its published layout) into ``dst`` for this target."""
    try:
        from pagecast.builder.eagle3 import convert_eagle3_head
    except ModuleNotFoundError as e:
        if e.name != "pagecast.builder.eagle3":
            raise
        raise BuildError(
            "speculative_config method eagle3 is not available in this build of pagecast (no EAGLE-3 "
            "converter); use method draft_model or ngram"
        ) from None
    from pagecast.builder import emit

    dims: dict[str, Any] = emit.make_manifest(state, {}).dims
    convert_eagle3_head(source, dst, dims)
