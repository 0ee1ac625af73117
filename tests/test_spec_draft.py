"""Speculative decoding with a draft model (runtime/spec_draft.py) and enginebuild's
--speculative-config: the drafts are the draft checkpoint's own greedy continuation, whatever
the catch-up (first call, after accepted or rejected drafts, chunked), a draft that cannot pair
with the target is refused with what to do, and a build records (and nests) its drafter."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from pagecast.runtime.request import Request
from pagecast.runtime.sampling_params import SamplingParams
from pagecast.runtime.speculative import SpeculativeConfig

# A smaller Llama than the target (tiny_llama_checkpoint: 3 layers of 96) with the same vocabulary.
DRAFT = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             tie_word_embeddings=False)  # untied: a tied tiny model repeats its last token, which would hide a shifted position


@pytest.fixture(scope="session")
def draft_checkpoint(tiny_checkpoint_factory) -> Path:  # type: ignore[no-untyped-def]
    return tiny_checkpoint_factory("llama", **DRAFT)


@pytest.fixture(scope="session")
def draft_artifact(tiny_artifact_factory) -> Path:  # type: ignore[no-untyped-def]
    return tiny_artifact_factory("llama", **DRAFT)


@pytest.fixture(scope="session")
def hf_draft(draft_checkpoint):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(draft_checkpoint), dtype=torch.float32).eval()


def greedy(model, ids: list[int], k: int) -> list[int]:  # type: ignore[no-untyped-def]
    """The draft checkpoint's greedy continuation of ``ids`` under transformers (fp32, argmax
    at each step: no generation config, so an EOS does not end it)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(k):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


def make_core(artifact: Path, **options):  # type: ignore[no-untyped-def]
    from pagecast.runtime.engine_core import EngineCore, EngineOptions

    return EngineCore(artifact, EngineOptions(max_num_seqs=4, **options), load_tokenizer=False)


@pytest.fixture(scope="session")
def target_core(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    return make_core(tiny_llama_artifact)


def proposer_for(core, draft_artifact: Path, k: int = 3):  # type: ignore[no-untyped-def]
    from pagecast.runtime.speculative import make_proposer

    config = SpeculativeConfig(method="draft_model", model=str(draft_artifact), num_speculative_tokens=k)
    proposer = make_proposer(config, core)
    proposer.bind_kv_cache(core.block_pool.num_blocks)
    return proposer


def request(rid: str, ids: list[int], first_block: int, num_blocks: int = 6) -> Request:
    """A decoding request as the core hands it to propose: its blocks allocated (distinct per request)."""
    r = Request(rid, ids, SamplingParams(max_tokens=64, temperature=0.0), eos_token_ids=frozenset(), max_tokens=64)
    r.block_ids = list(range(first_block, first_block + num_blocks))
    return r


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def test_drafts_are_the_draft_models_greedy_continuation(target_core, draft_artifact, hf_draft):  # type: ignore[no-untyped-def]
    proposer = proposer_for(target_core, draft_artifact, k=3)
    reqs = [request("a", prompt(1, 21), 1), request("b", prompt(2, 5), 11), request("c", prompt(3, 9), 21)]
    drafts = proposer.propose(reqs, [3, 1, 0])
    assert drafts[0] == greedy(hf_draft, reqs[0].all_token_ids, 3)
    assert drafts[1] == greedy(hf_draft, reqs[1].all_token_ids, 1)
    assert drafts[2] == []


def test_the_next_propose_catches_up_after_accepted_and_rejected_drafts(target_core, draft_artifact, hf_draft):  # type: ignore[no-untyped-def]
    proposer = proposer_for(target_core, draft_artifact, k=4)
    a, b, c = request("a", prompt(4, 13), 1), request("b", prompt(5, 30), 11), request("c", prompt(6, 7), 21)
    first = proposer.propose([a, b, c], [4, 4, 4])
    # a: two drafts accepted, then the target's own token; b: none accepted; c: all four and a bonus.
    a.all_token_ids += first[0][:2] + [(first[0][2] + 1) % 49152]
    b.all_token_ids += [(first[1][0] + 7) % 49152]
    c.all_token_ids += first[2] + [17]
    seen: list[int] = []
    forward = proposer._forward
    proposer._forward = lambda reqs, ids, *rest: seen.append(len(ids)) or forward(reqs, ids, *rest)  # type: ignore[method-assign]
    second = proposer.propose([a, b, c], [4, 2, 3])
    assert second[0] == greedy(hf_draft, a.all_token_ids, 4)
    assert second[1] == greedy(hf_draft, b.all_token_ids, 2)
    assert second[2] == greedy(hf_draft, c.all_token_ids, 3)
    # The catch-up computed only what the draft had not: a's and b's last token, c's last draft
    # (never fed back) and its bonus token; then the decodes.
    assert seen[0] == 1 + 1 + 2
    # Later tokens known without a propose in between (a step without speculation) are caught up too.
    a.all_token_ids += [5, 6, 7]
    assert proposer.propose([a], [2]) == [greedy(hf_draft, a.all_token_ids, 2)]


def test_dropped_requests_are_computed_again_from_the_start(target_core, draft_artifact, hf_draft):  # type: ignore[no-untyped-def]
    proposer = proposer_for(target_core, draft_artifact, k=2)
    a = request("a", prompt(7, 17), 1)
    proposer.propose([a], [2])
    proposer.drop({"a"})
    # Preempted: new blocks, whose draft K/V was never written.
    a.block_ids = list(range(31, 37))
    a.all_token_ids += [9, 10]
    seen: list[int] = []
    forward = proposer._forward
    proposer._forward = lambda reqs, ids, *rest: seen.append(len(ids)) or forward(reqs, ids, *rest)  # type: ignore[method-assign]
    assert proposer.propose([a], [2]) == [greedy(hf_draft, a.all_token_ids, 2)]
    assert seen[0] == 19


def test_a_long_catch_up_is_chunked_by_the_token_budget(tiny_llama_artifact, draft_artifact, hf_draft):  # type: ignore[no-untyped-def]
    core = make_core(tiny_llama_artifact, max_num_batched_tokens=8)
    proposer = proposer_for(core, draft_artifact, k=3)
    seen: list[int] = []
    forward = proposer._forward
    proposer._forward = lambda reqs, ids, *rest: seen.append(len(ids)) or forward(reqs, ids, *rest)  # type: ignore[method-assign]
    reqs = [request("a", prompt(8, 19), 1), request("b", prompt(9, 6), 11)]
    drafts = proposer.propose(reqs, [3, 3])
    assert drafts == [greedy(hf_draft, r.all_token_ids, 3) for r in reqs]
    assert seen == [8, 8, 8, 1, 2, 2]  # 25 tokens in forwards of at most 8, then two decodes of 2


def test_kv_bytes_per_block_is_the_drafts_own(target_core, draft_artifact):  # type: ignore[no-untyped-def]
    proposer = proposer_for(target_core, draft_artifact)
    plan = json.loads((draft_artifact / "memory_plan.json").read_text())
    assert proposer.kv_bytes_per_block == plan["bytes_per_block"]
    # The draft's cache shares the target's block ids: as many blocks.
    assert proposer.kv_cache.shape[2] == target_core.block_pool.num_blocks


def test_a_draft_with_another_vocabulary_is_refused(target_core, tiny_artifact_factory):  # type: ignore[no-untyped-def]
    other = tiny_artifact_factory("llama", vocab_size=49280, **DRAFT)
    with pytest.raises(ValueError, match=r"vocabulary has 49280 tokens and the target's 49152.*same family"):
        proposer_for(target_core, other)


def test_a_draft_with_another_block_size_is_refused(target_core, draft_checkpoint, tmp_path):  # type: ignore[no-untyped-def]
    from conftest import build_artifact

    other = build_artifact(draft_checkpoint, tmp_path / "draft32", block_size=32)
    with pytest.raises(ValueError, match=r"--block-size 32 .* rebuild it with enginebuild --block-size 16"):
        proposer_for(target_core, other)


def test_a_missing_draft_is_refused(target_core, tmp_path):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="not a directory: give a draft artifact"):
        proposer_for(target_core, tmp_path / "nowhere")
