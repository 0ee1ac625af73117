"""Tensor parallelism on two GPUs (NCCL; run with `pytest -m gpu tests/test_tp_gpu.py`):
tuned Triton kernels at per-rank shapes, all-reduces inside the decode CUDA graphs.

- fp32 tiny models at TP=2 give transformers' greedy tokens (GQA split, one KV head
  replicated with biases and an untied padded vocabulary, qwen2, qwen3);
- a bf16 model at TP=2 gives TP=1's first tokens;
- the experimental symmetric-memory all-reduce gives the same tokens;
- a killed worker is an error within seconds (the NCCL group is aborted), not a hang;
- fewer visible GPUs than the degree is refused at load;
- AWQ / GPTQ int4 shards at TP=2 give transformers' tokens on the exactly dequantized checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import test_tp
import torch
from conftest import build_artifact
from engine_utils import hf_greedy
from tiny_models import make_checkpoint

from pagecast.runtime import LLM, SamplingParams

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

PROMPTS = [[1 + (i * 37 + j * 11) % 4000 for j in range(n)] for i, n in enumerate([5, 17, 33, 64, 100, 3, 250, 9])]
ENGINE = {"max_num_batched_tokens": 128, "max_num_seqs": 8, "kv_cache_memory": "256MiB"}
CASES = test_tp.CASES  # the same layouts as the CPU (gloo) tests


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_fp32_greedy_matches_transformers(tmp_path, case):  # type: ignore[no-untyped-def]

    family, overrides = CASES[case]
    ckpt = make_checkpoint(tmp_path / "ckpt", family, tokenizer=False, **overrides)
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="float32", tp=2, tune_budget_s=10.0)
    # Decode steps replay graphs with NCCL all-reduces inside.
    _assert_greedy_matches_transformers(ckpt, art, lambda llm: llm.engine.runner.graphs is not None)


def _assert_greedy_matches_transformers(ckpt, art, engine_check) -> None:  # type: ignore[no-untyped-def]
    """fp32 TP=2 greedy tokens of PROMPTS equal transformers' on the checkpoint; ``engine_check``
    asserts what the engine must be using (graphs, the all-reduce kind) before it generates."""
    from transformers import AutoModelForCausalLM

    llm = LLM(art, **ENGINE)
    try:
        assert engine_check(llm)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    finally:
        llm.engine.runner.close()
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).cuda().eval()
    for ids, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(hf, ids, 24), ids
    del llm, hf
    torch.cuda.empty_cache()


def test_tp2_bf16_equals_tp1_on_the_first_tokens(tmp_path):  # type: ignore[no-untyped-def]
    ckpt = make_checkpoint(
        tmp_path / "ckpt", "llama", tokenizer=False, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
        num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=32000,
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        art = build_artifact(ckpt, tmp_path / f"art{tp}", gpu="auto", dtype="bfloat16", tp=tp, tune_budget_s=20.0)
        llm = LLM(art, **ENGINE)
        try:
            tokens[tp] = [o.token_ids for o in llm.generate(PROMPTS, params)]
        finally:
            llm.engine.runner.close()
        del llm
        torch.cuda.empty_cache()
    # bf16 sums in another order at TP=2 (two partial products, then the all-reduce): the first
    # tokens must agree; later ones may drift where two logits are within bf16 rounding.
    agree = sum(a[:3] == b[:3] for a, b in zip(tokens[1], tokens[2]))
    assert agree >= len(PROMPTS) - 1, (tokens[1], tokens[2])
    assert all(a[0] == b[0] for a, b in zip(tokens[1], tokens[2]))


def test_tp2_symmetric_memory_all_reduce_matches_nccl(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """PAGECAST_TP_ALLREDUCE=symm_mem (one-shot all-reduce in symmetric memory, captured in the
    decode graphs) gives the tokens NCCL gives, in fp32 against transformers too."""

    from pagecast.runtime import parallel

    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", tokenizer=False)
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="float32", tp=2, tune_budget_s=5.0)
    monkeypatch.setattr(parallel, "ALL_REDUCE", "symm_mem")
    _assert_greedy_matches_transformers(ckpt, art, lambda llm: llm.engine.runner.kernels.tp_symm is not None)


@pytest.mark.timeout(300)
def test_killed_worker_is_an_error_not_a_hang_on_gpu(tmp_path):  # type: ignore[no-untyped-def]
    from pagecast.runtime.parallel import WorkerDiedError

    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", tokenizer=False)
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="float32", tp=2, tune_budget_s=5.0)
    llm = LLM(art, **ENGINE)
    try:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        assert len(llm.generate(PROMPTS[:2], params)[0].token_ids) == 16
        os.kill(llm.engine.runner.workers.procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="worker rank 1"):
            llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        assert time.monotonic() - start < 60
    finally:
        llm.engine.runner.close()


def test_fewer_visible_gpus_than_tp_is_refused(tmp_path):  # type: ignore[no-untyped-def]
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", tokenizer=False)
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="float32", tp=2, tune_budget_s=5.0)
    code = f"from pagecast.runtime import LLM; LLM({str(art)!r})"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ, CUDA_VISIBLE_DEVICES="0"), capture_output=True,
        text=True, timeout=120, check=False,
    )
    assert proc.returncode != 0
    assert "built with --tp 2 and needs 2 GPUs, but 1 are visible" in proc.stderr


@pytest.mark.parametrize("case", ["awq-g64-qwen2-bias", "gptq-g64-sym-actorder-mlp-bias", "gptq_v2-g32-asym-one-kv-replicated"])
def test_tp2_int4_fp32_greedy_matches_transformers_on_the_exact_dequantization(tmp_path, case):  # type: ignore[no-untyped-def]
    # int4 shards on two GPUs (test_quant_tp.py's cases, run there on gloo): the W4A16 kernels
    # at per-rank shapes (o_proj's act-order shard padded to whole groups), NCCL all-reduces in
    # the decode graphs; fp32 activations, so the tokens must be transformers' on the checkpoint
    # dequantized exactly.
    import test_quant_tp
    from quant_writer import write

    family, overrides, fmt = test_quant_tp.CASES[case]
    src = make_checkpoint(tmp_path / "float", family, tokenizer=False, **{**test_quant_tp.SHAPE, **overrides})
    src = test_quant_tp._with_random_biases(src, tmp_path / "biased")
    ckpt, deq = write(src, tmp_path / case, fmt)
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="float32", tp=2, tune_budget_s=10.0)
    _assert_greedy_matches_transformers(deq, art, lambda llm: llm.engine.runner.graphs is not None)
