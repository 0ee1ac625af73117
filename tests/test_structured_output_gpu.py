"""Structured output on a GPU (run with `pytest -m gpu` on the accelerator): CUDA graphs, the
asynchronous engine (the in-flight token fed to the matcher after the forward pass is queued)
and xgrammar's bitmask kernel on the device. Constrained outputs validate and are the same in
both scheduling modes (the same batches, so the same tokens)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_artifact
from test_structured_output import PERSON, PROMPTS, Person
from tiny_models import make_checkpoint

from pagecast.runtime import LLM, SamplingParams

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_structured_output_on_gpu_in_both_modes(tmp_path):  # type: ignore[no-untyped-def]
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama")
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="float32", tune_budget_s=10.0)
    plain = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    constrained = [
        SamplingParams(max_tokens=200, temperature=0.0, structured_output=PERSON),
        SamplingParams(max_tokens=200, temperature=0.9, seed=5, structured_output=PERSON),
    ]
    prompts = PROMPTS * 4
    params = [plain if i % 2 == 0 else constrained[(i // 2) % 2] for i in range(len(prompts))]
    results = []
    for mode in (False, True):
        llm = LLM(art, async_scheduling=mode, max_num_seqs=16, kv_cache_memory="256MiB")
        assert llm.engine.runner.graphs is not None
        mixed = llm.generate(prompts, params)
        # (Unconstrained neighbours against a run without constrained ones is the CPU test's: on a
        # GPU a different batch size may pick another GEMM algorithm, so greedy ties may differ.)
        for out in mixed[1::2]:
            assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
            Person.model_validate_json(out.outputs[0].text)
        results.append([o.outputs[0].token_ids for o in mixed])
        assert llm.engine.block_pool.num_used_blocks == 0
        del llm
        torch.cuda.empty_cache()
    assert results[0] == results[1]


# A fresh process (no kernel in memory yet), serving the artifact as engine-serve would: its
# Triton cache is the artifact's. Constrained batches of 16, 3 and 1 rows reach xgrammar's mask
# kernel at its three row-count specialisations; prints the kernels Triton compiled meanwhile.
SERVE_CONSTRAINED = """
import json, sys
from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.kernel_cache import TritonCompiles
from pagecast.runtime.sampling_params import StructuredOutput

compiles = TritonCompiles()
llm = LLM(sys.argv[1], max_num_seqs=16, kv_cache_memory="256MiB")
started = compiles.count
flags = StructuredOutput("json_schema", {"type": "object", "required": ["flags"], "properties": {
    "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 8}}})
for rows in (16, 3, 1):
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, structured_output=flags) for i in range(rows)]
    llm.generate(["Flags:"] * rows, params, use_tqdm=False)
print(json.dumps(compiles.names[started:]))
"""


def test_the_grammar_mask_kernel_is_served_from_the_artifacts_cache(tmp_path):  # type: ignore[no-untyped-def]
    import json
    import os
    import subprocess
    import sys

    ckpt = make_checkpoint(tmp_path / "ckpt", "llama")
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", tune_budget_s=10.0)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", SERVE_CONSTRAINED, str(art)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "apply_token_bitmask_inplace_kernel" not in compiled, compiled
