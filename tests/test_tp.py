"""Tensor parallelism on the CPU (gloo): TP=2 artifacts of tiny checkpoints against transformers.

Each case is one TP=2 build and one engine with a spawned worker process: GQA with KV heads
split across ranks, one KV head replicated on both ranks (with an odd vocabulary padded for
the vocab-parallel LM head, untied, with o_proj and MLP biases), qwen2's q/k/v biases and
qwen3's q/k norms. A torch.distributed process group is one per process, so the engines run
one after another and each is closed at the end of its test.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import openai
import pytest
import torch
from conftest import build_artifact
from engine_utils import hf_greedy
from server_support import make_engine, serve
from test_engine_process import assert_details_only_in_the_log
from transformers import AutoModelForCausalLM

from pagecast.runtime import LLM, SamplingParams
from pagecast.runtime.artifact import load_manifest
from pagecast.runtime.errors import ArtifactError, BuildError
from pagecast.runtime.parallel import WorkerDiedError

PROMPTS = ["Hello, my name is", "一二三四五六七八九十", " ".join(str(i) for i in range(30)), "a"]
MAX_TOKENS = 8
ENGINE = {"max_num_batched_tokens": 32, "max_num_seqs": 4, "kv_cache_memory": "4MiB"}

CASES = {
    "gqa-kv-split": ("llama", {}),  # 6 query / 2 KV heads: 3 / 1 per rank
    "one-kv-replicated": (
        "llama",
        {"num_key_value_heads": 1, "vocab_size": 49155, "tie_word_embeddings": False,
         "attention_bias": True, "mlp_bias": True},
    ),
    "qwen2-qkv-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
}


@pytest.fixture(scope="module")
def tp2_artifact(tiny_checkpoint_factory, tmp_path_factory):  # type: ignore[no-untyped-def]
    cache: dict[str, Path] = {}

    def make(case: str) -> Path:
        if case not in cache:
            family, overrides = CASES[case]
            ckpt = tiny_checkpoint_factory(family, **overrides)
            cache[case] = build_artifact(ckpt, tmp_path_factory.mktemp(f"tp2-{case}") / "engine", tp=2)
        return cache[case]

    return make


def _close(llm: LLM) -> None:
    llm.engine.runner.close()


def _worker_pids(llm: LLM) -> list[int]:
    workers = llm.engine.runner.workers
    assert workers is not None, "a TP=2 artifact must run with a worker process"
    return [p.pid for p in workers.procs]


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_greedy_tokens_match_transformers(case, tp2_artifact, tiny_checkpoint_factory):  # type: ignore[no-untyped-def]
    family, overrides = CASES[case]
    artifact = tp2_artifact(case)
    llm = LLM(artifact, **ENGINE)
    try:
        assert len(_worker_pids(llm)) == 1
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    finally:
        _close(llm)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint_factory(family, **overrides)), dtype=torch.float32)
    hf.eval()
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(hf, out.prompt_token_ids, MAX_TOKENS), prompt


def test_tp2_artifact_holds_one_shard_per_rank(tp2_artifact):  # type: ignore[no-untyped-def]
    from safetensors import safe_open

    artifact = tp2_artifact("one-kv-replicated")
    manifest = load_manifest(artifact)
    assert manifest.tp == 2
    assert manifest.layout["num_heads"] == 3 and manifest.layout["num_kv_heads"] == 1
    assert manifest.layout["kv_head_replicas"] == 2  # one KV head: both ranks hold it
    assert manifest.layout["vocab_per_rank"] == 24578  # 49155 rows padded to 2 x 24578
    assert sorted(f for f in manifest.files if f.startswith("weights/")) == [
        "weights/rank0.safetensors", "weights/rank1.safetensors"
    ]
    shapes = []
    for rank in (0, 1):
        with safe_open(str(artifact / "weights" / f"rank{rank}.safetensors"), "pt") as f:
            shapes.append({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})  # noqa: SIM118
    assert shapes[0] == shapes[1]
    s = shapes[0]
    assert s["layers.0.qkv_proj.weight"] == ((3 + 2 * 1) * 16, 96)
    assert s["layers.0.qkv_proj.bias"] == ((3 + 2 * 1) * 16,)
    assert s["layers.0.o_proj.weight"] == (96, 48)
    assert s["layers.0.o_proj.bias"] == (96,)  # row-parallel bias: whole, added after the all-reduce
    assert s["layers.0.gate_up_proj.weight"] == (160, 96)
    assert s["layers.0.down_proj.weight"] == (96, 80)
    assert s["embed_tokens.weight"] == s["lm_head.weight"] == (24578, 96)
    plan = json.loads((artifact / "memory_plan.json").read_text())
    assert plan["tp"] == 2 and plan["bytes_per_token"] == 2 * 3 * 1 * 16 * 4  # one rank's KV heads
    assert "tensor parallel: 2 ranks" in (artifact / "report.md").read_text()


def test_tp2_through_engine_serve_and_a_dead_worker_gives_503(tp2_artifact, tiny_checkpoint_factory, caplog):  # type: ignore[no-untyped-def]
    artifact = tp2_artifact("gqa-kv-split")
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint_factory("llama")), dtype=torch.float32)
    engine = make_engine(artifact, max_num_seqs=4, max_num_batched_tokens=32)
    try:
        with serve({"tiny": engine}) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
            prompt = engine.tokenize(PROMPTS[0])
            reply = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            assert reply.choices[0].model_extra["token_ids"] == hf_greedy(hf, prompt, MAX_TOKENS)

            workers = _children(engine._client.process.pid)  # the engine core's TP worker (rank 1)
            assert len(workers) == 1
            os.kill(workers[0], signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(openai.APIStatusError) as err:
                client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert err.value.status_code == 503
            # What failed is in the server's log, under the error id the client gets.
            assert_details_only_in_the_log(str(err.value), caplog, "tensor-parallel worker rank 1")
            assert time.monotonic() - start < 30
    finally:
        engine.shutdown()


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` that run a tensor-parallel worker (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"pagecast.runtime.tp_worker" in cmdline:
                out.append(int(entry.name))
    return out


@pytest.mark.timeout(120)
def test_killed_worker_is_an_error_not_a_hang(tp2_artifact):  # type: ignore[no-untyped-def]
    llm = LLM(tp2_artifact("gqa-kv-split"), **ENGINE)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate(PROMPTS[:1], params)[0].token_ids) == 4
        pid = _worker_pids(llm)[0]
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 died \(exit code -9\)"):
            llm.generate(PROMPTS[:2], params)
        assert time.monotonic() - start < 30
        with pytest.raises(WorkerDiedError):  # and it stays an error
            llm.generate(PROMPTS[:1], params)
    finally:
        _close(llm)


def test_bad_degree_is_refused_at_build(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    ckpt = tiny_checkpoint_factory("llama")  # 6 query heads, 2 KV heads
    with pytest.raises(BuildError, match=r"--tp 4 cannot split this model's 6 query heads \(2 KV heads\)"):
        build_artifact(ckpt, tmp_path / "tp4", tp=4)
    with pytest.raises(BuildError, match=r"--tp 3 cannot split this model's 2 KV heads \(6 query heads\)"):
        build_artifact(ckpt, tmp_path / "tp3", tp=3)
    assert not (tmp_path / "tp4").exists() and not (tmp_path / "tp3").exists()


def test_bad_degree_on_the_command_line(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    from click.testing import CliRunner

    from pagecast.builder.cli import main

    result = CliRunner().invoke(
        main, ["--model", str(tiny_checkpoint_factory("llama")), "--tp", "4", "--output", str(tmp_path / "a"), "--quiet"]
    )
    assert result.exit_code == 2
    assert "6 query heads" in result.output


def test_fewer_gpus_than_tp_is_refused(tp2_artifact, monkeypatch):  # type: ignore[no-untyped-def]
    import dataclasses

    from pagecast.runtime import loader
    from pagecast.runtime.artifact import TargetDevice

    manifest = dataclasses.replace(
        load_manifest(tp2_artifact("gqa-kv-split")), target=TargetDevice("cuda", "h200", (9, 0), True)
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ArtifactError, match=r"built with --tp 2 and needs 2 GPUs, but 1 are visible"):
        loader.check_device(manifest)


@pytest.mark.parametrize("tp", [1, 2])
def test_dummy_artifacts_carry_no_weight_files(tp, tmp_path):  # type: ignore[no-untyped-def]
    from tiny_models import tiny_config

    config_dir = tmp_path / "config-only"
    tiny_config("llama").save_pretrained(str(config_dir))
    artifact = build_artifact(config_dir, tmp_path / "engine", tp=tp, load_format="dummy")
    manifest = load_manifest(artifact)
    assert not (artifact / "weights").exists()
    assert not [f for f in manifest.files if f.startswith("weights/")]
    assert manifest.layout["weights"] == "random" and manifest.layout["tp"] == tp
    assert manifest.layout["tensors"]["layers.0.qkv_proj.weight"] == [(6 + 2 * 2) * 16 // tp, 96]
    runs = []
    for _ in range(2 if tp == 1 else 1):
        llm = LLM(artifact, **ENGINE)
        try:
            runs.append(llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
        finally:
            _close(llm)
    assert len(runs[0][0].token_ids) == 4
    assert all(r[0].token_ids == runs[0][0].token_ids for r in runs)  # seeded: the same weights every load


def test_tp4_shards_hold_the_right_heads(tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    """8 query / 2 KV heads at TP=4: each rank holds 2 query heads and the one KV head they
    attend to (KV heads replicated on 2 ranks each); gate/up, o/down and the vocabulary cut alike."""
    from safetensors.torch import load_file

    ckpt = tiny_checkpoint_factory("llama", num_attention_heads=8, num_key_value_heads=2, attention_bias=True)
    artifact = build_artifact(ckpt, tmp_path / "tp4", tp=4)
    src = load_file(str(ckpt / "model.safetensors"))
    a, d, inter = "model.layers.1.self_attn", 16, 160
    for rank in range(4):
        w = load_file(str(artifact / "weights" / f"rank{rank}.safetensors"))
        kv_head = rank // 2  # query heads 2r, 2r + 1 of groups of 4 share KV head r // 2
        for suffix in ("weight", "bias"):
            q, k, v = w[f"layers.1.qkv_proj.{suffix}"].split([2 * d, d, d])
            torch.testing.assert_close(q, src[f"{a}.q_proj.{suffix}"][2 * rank * d : (2 * rank + 2) * d], rtol=0, atol=0)
            torch.testing.assert_close(k, src[f"{a}.k_proj.{suffix}"][kv_head * d : (kv_head + 1) * d], rtol=0, atol=0)
            torch.testing.assert_close(v, src[f"{a}.v_proj.{suffix}"][kv_head * d : (kv_head + 1) * d], rtol=0, atol=0)
        torch.testing.assert_close(w["layers.1.o_proj.weight"], src[f"{a}.o_proj.weight"][:, 2 * rank * d : (2 * rank + 2) * d])
        gate, up = w["layers.1.gate_up_proj.weight"].split(inter // 4)
        rows = slice(rank * inter // 4, (rank + 1) * inter // 4)
        torch.testing.assert_close(gate, src["model.layers.1.mlp.gate_proj.weight"][rows])
        torch.testing.assert_close(up, src["model.layers.1.mlp.up_proj.weight"][rows])
        torch.testing.assert_close(w["layers.1.down_proj.weight"], src["model.layers.1.mlp.down_proj.weight"][:, rows])
        vocab = slice(rank * 12288, (rank + 1) * 12288)
        torch.testing.assert_close(w["embed_tokens.weight"], src["model.embed_tokens.weight"][vocab])


def test_tp2_speculative_decoding_gives_the_same_tokens(tp2_artifact):  # type: ignore[no-untyped-def]
    """n-gram drafts verified on a TP=2 engine (the verifying step, laid out as decode rows, is
    broadcast to the worker like any step): the tokens of the engine without speculation."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 11, 12, 11, 12, 11]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}):
        llm = LLM(tp2_artifact("gqa-kv-split"), **ENGINE, speculative_config=spec)
        try:
            outputs[spec is not None] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            if spec is not None:
                assert llm.engine.core.spec_stats.num_accepted_tokens > 0
        finally:
            _close(llm)
    assert outputs[True] == outputs[False]
