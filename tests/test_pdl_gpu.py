"""Programmatic dependent launch on a GPU (run with `pytest -m gpu` on an sm_90 accelerator): an
artifact built with PAGECAST_PDL=1 records it, serves the same greedy tokens as one built without
(bf16: the same kernel configs, reused with --tuning-from, and arithmetic; only their scheduling
differs), with and without CUDA graphs, at one row (the skinny GEMMs) and at several, and (with
graphs, as served) compiles no kernel at start or while serving (tests/test_pdl.py checks on the CPU
that each kernel waits before its first memory access)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_artifact
from tiny_models import make_checkpoint

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("needs an sm_90 or newer CUDA GPU", allow_module_level=True)

SERVE = """
import json, sys
from pagecast.kernels import pdl
from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.kernel_cache import TritonCompiles

compiles = TritonCompiles()
prompts = [[1 + (i * 37 + j * 11) % 4000 for j in range(n)] for i, n in enumerate([5, 17, 33, 64, 3, 9])]
greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
result = {}
for graphs in (True, False):
    llm = LLM(sys.argv[1], max_num_seqs=8, kv_cache_memory="256MiB", cuda_graphs=graphs)
    result[f"pdl_{graphs}"] = pdl.enabled()
    result[f"batch_{graphs}"] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    result[f"one_{graphs}"] = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], greedy, use_tqdm=False)]
    if graphs:  # the serving default: every kernel from the artifact
        result["compiles"] = list(compiles.names)
    del llm
print(json.dumps(result))
"""


def test_an_artifact_built_with_pdl_serves_the_same_tokens_and_compiles_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", tokenizer=False)
    served = {}
    for on in (False, True):
        monkeypatch.setenv("PAGECAST_PDL", "1" if on else "0")
        # The PDL build keeps the other build's kernel configs (--tuning-from): two independent tunings
        # may pick configs that sum in another order, and a bf16 greedy token then flips (seen on the
        # H200, 2026-12-04: 20 tokens in, one sequence of six), which says nothing about PDL.
        reuse = {"tuning_from": tmp_path / "art-False"} if on else {}
        art = build_artifact(ckpt, tmp_path / f"art-{on}", gpu="auto", dtype="bfloat16", tune_budget_s=10.0, **reuse)
        table = json.loads((art / "tuning.json").read_text())
        assert table["pdl"] is on
        if on:
            other = json.loads((tmp_path / "art-False" / "tuning.json").read_text())
            assert {k: {b: e["config"] for b, e in v.items()} for k, v in table["kernels"].items()} == {
                k: {b: e["config"] for b, e in v.items()} for k, v in other["kernels"].items()
            }
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PAGECAST_PDL")}
        proc = subprocess.run(
            [sys.executable, "-c", SERVE, str(art)], env=env, capture_output=True, text=True, timeout=600, check=False
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["pdl_True"] is on and result["pdl_False"] is on  # from the table, not the environment
        assert result["compiles"] == []
        assert result["batch_True"] == result["batch_False"] and result["one_True"] == result["one_False"]
        served[on] = result
    assert served[True]["batch_True"] == served[False]["batch_True"]
    assert served[True]["one_True"] == served[False]["one_True"]
