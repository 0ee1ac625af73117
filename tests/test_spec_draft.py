"""Speculative decoding with a draft model (runtime/spec_draft.py) and enginebuild's
--speculative-config: the drafts are the draft checkpoint's own greedy continuation, whatever
the catch-up (first call, after accepted or rejected drafts, chunked), a draft that cannot pair
with the target is refused with what to do, and a build records (and nests) its drafter."""

from __future__ import annotations

import json
import os
import random
import shlex
from pathlib import Path

import pytest
import torch

from pagecast.runtime.request import Request
from pagecast.runtime.sampling_params import SamplingParams
from pagecast.runtime.speculative import SpeculativeConfig

# A smaller Llama than the target (tiny_llama_checkpoint: 3 layers of 96) with the same vocabulary.
# Untied: a tied tiny model repeats its last token, which would hide a shifted position.
DRAFT = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "tie_word_embeddings": False}  # fmt: skip


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


# -- enginebuild --speculative-config ---------------------------------------------------------


def draft_config(model: Path | str, k: int = 3) -> dict:  # type: ignore[type-arg]
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="session")
def speculative_artifact(tiny_llama_checkpoint, draft_checkpoint, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """The tiny target built with its draft checkpoint nested (built with the target's options)."""
    from conftest import build_artifact

    out = tmp_path_factory.mktemp("spec-art") / "engine"
    return build_artifact(tiny_llama_checkpoint, out, speculative_config=json.dumps(draft_config(draft_checkpoint)))


def test_a_draft_checkpoint_is_built_into_the_artifact_and_recorded(speculative_artifact, draft_checkpoint):  # type: ignore[no-untyped-def]
    from pagecast.runtime.artifact import load_manifest, rebuild_command

    manifest = load_manifest(speculative_artifact)
    assert manifest.speculative == {**SpeculativeConfig("draft_model", 3, "speculative").to_dict()}
    nested = load_manifest(speculative_artifact / "speculative")
    assert (nested.block_size, nested.max_model_len, nested.dtype) == (16, manifest.max_model_len, manifest.dtype)
    assert nested.dims["num_layers"] == 2 and nested.dims["vocab_size"] == manifest.dims["vocab_size"]
    # Every nested file is listed and hashed by the target's manifest: the artifact is self-contained.
    nested_files = {f"speculative/{rel}" for rel in [*nested.files, "manifest.json"]}
    assert nested_files <= set(manifest.files)
    # The build options keep the draft's source, for the rebuild command.
    assert manifest.build_options["speculative_config"]["model"] == str(draft_checkpoint)
    command = shlex.split(rebuild_command(speculative_artifact, manifest))
    given = json.loads(command[command.index("--speculative-config") + 1])
    assert SpeculativeConfig.parse(given) == SpeculativeConfig.parse(draft_config(draft_checkpoint))


def test_the_nested_draft_is_verified_with_the_artifact(speculative_artifact, tmp_path):  # type: ignore[no-untyped-def]
    import shutil

    from pagecast.runtime.errors import ArtifactError
    from pagecast.runtime.loader import load_artifact

    load_artifact(speculative_artifact, load_tokenizer=False)  # intact: loads
    changed = shutil.copytree(speculative_artifact, tmp_path / "changed")
    with open(changed / "speculative" / "memory_plan.json", "a") as f:
        f.write(" ")
    with pytest.raises(ArtifactError, match="speculative/memory_plan.json does not match the manifest"):
        load_artifact(changed, load_tokenizer=False)
    # The draft's weights are checked when the draft loads (against its own manifest, which the
    # target's hashes), not by every load of the target.
    weights = shutil.copytree(speculative_artifact, tmp_path / "weights")
    with open(weights / "speculative" / "weights" / "rank0.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\xff\xff\xff\xff")
    load_artifact(weights, load_tokenizer=False)
    with pytest.raises(ArtifactError, match="rank0.safetensors"):
        load_artifact(weights / "speculative", load_tokenizer=False)
    extra = shutil.copytree(speculative_artifact, tmp_path / "extra")
    (extra / "speculative" / "planted.py").write_text("")
    with pytest.raises(ArtifactError, match="files not listed in the manifest: speculative/planted.py"):
        load_artifact(extra, load_tokenizer=False)


@pytest.mark.parametrize("name", ["ABSOLUTE", "../elsewhere"])
def test_a_manifest_whose_drafter_lies_outside_the_artifact_is_refused(speculative_artifact, tmp_path, name):  # type: ignore[no-untyped-def]
    """The drafter the manifest names is code and weights that run in the engine: like every
    other name the manifest lists, it must lie inside the artifact."""
    import shutil

    from pagecast.runtime.errors import ArtifactError
    from pagecast.runtime.loader import load_artifact

    elsewhere = shutil.copytree(speculative_artifact / "speculative", tmp_path / "elsewhere")
    changed = shutil.copytree(speculative_artifact, tmp_path / "art")
    manifest = json.loads((changed / "manifest.json").read_text())
    manifest["speculative"]["model"] = str(elsewhere) if name == "ABSOLUTE" else name
    (changed / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="not a relative path inside the artifact"):
        load_artifact(changed, load_tokenizer=False)


def test_the_manifests_entry_makes_a_working_proposer(speculative_artifact, hf_draft, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    (tmp_path / "speculative").mkdir()  # a directory of that name where the engine starts is not the draft
    monkeypatch.chdir(tmp_path)
    core = make_core(speculative_artifact)  # no speculative_config: the artifact's own
    proposer = core.proposer
    assert proposer.artifact.path == speculative_artifact / "speculative"  # resolved against the artifact
    assert proposer.kv_cache.shape[2] == core.block_pool.num_blocks  # bound by the core
    r = request("a", prompt(10, 11), 1)
    assert proposer.propose([r], [3]) == [greedy(hf_draft, r.all_token_ids, 3)]


def test_a_draft_artifact_is_copied_in(tiny_llama_checkpoint, draft_artifact, tmp_path):  # type: ignore[no-untyped-def]
    from conftest import build_artifact

    from pagecast.runtime.artifact import load_manifest
    from pagecast.runtime.loader import load_artifact

    out = build_artifact(tiny_llama_checkpoint, tmp_path / "engine", speculative_config=draft_config(draft_artifact, 2))
    assert load_manifest(out).speculative["model"] == "speculative"
    assert (out / "speculative" / "manifest.json").read_bytes() == (draft_artifact / "manifest.json").read_bytes()
    load_artifact(out, load_tokenizer=False)


def test_ngram_records_only_the_config(tiny_llama_checkpoint, tmp_path):  # type: ignore[no-untyped-def]
    from conftest import build_artifact

    from pagecast.runtime.artifact import load_manifest

    out = build_artifact(tiny_llama_checkpoint, tmp_path / "engine", speculative_config='{"method": "ngram"}')
    assert load_manifest(out).speculative == SpeculativeConfig("ngram").to_dict()
    assert not (out / "speculative").exists()


def test_an_artifact_built_without_it_has_no_entry(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    from pagecast.runtime.artifact import load_manifest

    # Absent from the file, so runtimes from before it still read the artifact.
    assert "speculative" not in json.loads((tiny_llama_artifact / "manifest.json").read_text())
    assert load_manifest(tiny_llama_artifact).speculative is None


def test_enginebuild_refuses_an_unknown_key(tiny_llama_checkpoint, tmp_path):  # type: ignore[no-untyped-def]
    from click.testing import CliRunner

    from pagecast.builder.cli import main as enginebuild

    args = ["--model", str(tiny_llama_checkpoint), "--gpu", "cpu", "--output", str(tmp_path / "e"), "--quiet",
            "--speculative-config", '{"method": "draft_model", "modle": "x"}']  # fmt: skip
    result = CliRunner().invoke(enginebuild, args)
    assert result.exit_code == 2
    assert "enginebuild: error: speculative_config has unknown key(s) modle; known:" in result.stderr
    assert not (tmp_path / "e").exists()


def test_enginebuild_refuses_a_draft_with_another_vocabulary(tiny_llama_checkpoint, tiny_checkpoint_factory, tmp_path):  # type: ignore[no-untyped-def]
    from click.testing import CliRunner

    from pagecast.builder.cli import main as enginebuild

    other = tiny_checkpoint_factory("llama", vocab_size=49280, **DRAFT)
    args = ["--model", str(tiny_llama_checkpoint), "--gpu", "cpu", "--output", str(tmp_path / "e"), "--quiet",
            "--speculative-config", json.dumps(draft_config(other))]  # fmt: skip
    result = CliRunner().invoke(enginebuild, args)
    assert result.exit_code == 2
    assert "its vocabulary has 49280 tokens and the target's 49152" in result.stderr
    assert not (tmp_path / "e").exists()  # no half artifact


def test_eagle3_without_its_converter_is_a_clear_build_error(tiny_llama_checkpoint, tmp_path):  # type: ignore[no-untyped-def]
    import importlib.util

    from conftest import build_artifact

    from pagecast.runtime.errors import BuildError

    if importlib.util.find_spec("pagecast.builder.eagle3") is not None:
        pytest.skip("this build has the EAGLE-3 converter")
    with pytest.raises(BuildError, match="eagle3 is not available in this build"):
        build_artifact(tiny_llama_checkpoint, tmp_path / "e", speculative_config={"method": "eagle3", "model": "x"})


def test_decode_steps_replay_graphs_where_they_fit(tiny_llama_artifact, draft_artifact, hf_draft):  # type: ignore[no-untyped-def]
    """The draft's decode steps through its decode graphs (on the CPU a stand-in that replays by
    running the same forward on the graphs' buffers, tests/test_lazy_graphs.py), batches padded
    to a captured size: the same drafts."""
    from test_lazy_graphs import ReplayOnCPU

    core = make_core(tiny_llama_artifact)
    proposer = proposer_for(core, draft_artifact, k=4)
    proposer.graph_class = ReplayOnCPU
    proposer._graph_batch_limit = 4  # as on a GPU with cuda_graphs
    proposer.bind_kv_cache(core.block_pool.num_blocks)
    graphs = proposer.graphs
    assert graphs is not None and sorted(set(graphs.captures)) == [1, 2, 4]
    reqs = [request(str(i), prompt(20 + i, 5 + 4 * i), 1 + 10 * i) for i in range(3)]
    drafts = proposer.propose(reqs, [4, 4, 2])
    assert drafts == [greedy(hf_draft, r.all_token_ids, k) for r, k in zip(reqs, [4, 4, 2])]
    assert graphs.replays == [4, 2, 2]  # 3 requests padded to 4, then the two that want more


def test_the_drafts_compiled_kernels_join_the_targets_cache(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """Loading the draft points Triton at its own private cache copy; the proposer merges it into
    the target's and points Triton back, so neither model's kernels compile at serve time."""
    from types import SimpleNamespace

    from pagecast.runtime import spec_draft

    (tmp_path / "target" / "triton_cache").mkdir(parents=True)
    target_copy, draft_copy = tmp_path / "target-copy", tmp_path / "draft-copy"
    (target_copy / "aa").mkdir(parents=True)
    (target_copy / "aa" / "k.cubin").write_text("target kernel")
    (draft_copy / "bb").mkdir(parents=True)
    (draft_copy / "bb" / "d.cubin").write_text("draft kernel")
    (draft_copy / "bb" / "__grp__d.json").write_text(json.dumps({"child_paths": {"d.cubin": "/gone/bb/d.cubin"}}))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(target_copy))

    def load(path, verify_weights, load_tokenizer):  # type: ignore[no-untyped-def]
        monkeypatch.setenv("TRITON_CACHE_DIR", str(draft_copy))
        return "draft"

    monkeypatch.setattr(spec_draft, "load_artifact", load)
    core = SimpleNamespace(artifact=SimpleNamespace(path=tmp_path / "target"), options=SimpleNamespace(verify_weights=True))
    assert spec_draft._load_draft(tmp_path, core) == "draft"
    assert os.environ["TRITON_CACHE_DIR"] == str(target_copy)
    assert (target_copy / "aa" / "k.cubin").read_text() == "target kernel"
    group = json.loads((target_copy / "bb" / "__grp__d.json").read_text())
    assert group["child_paths"] == {"d.cubin": str(target_copy / "bb" / "d.cubin")}


# -- end to end: LLM with a draft model ------------------------------------------------------

E2E_PROMPTS = [prompt(30 + i, n) for i, n in enumerate((4, 9, 17, 6))]
E2E_GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def generate(llm) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [o.outputs[0].token_ids for o in llm.generate(E2E_PROMPTS, E2E_GREEDY, use_tqdm=False)]


@pytest.fixture(scope="session")
def plain_outputs(tiny_llama_artifact) -> list[list[int]]:  # type: ignore[no-untyped-def]
    from pagecast.runtime import LLM

    return generate(LLM(tiny_llama_artifact, max_num_seqs=4, speculative_config="off"))


@pytest.mark.parametrize("drafter", ["small", "itself"])
def test_llm_with_a_draft_model_gives_the_same_greedy_tokens(tiny_llama_artifact, draft_artifact, plain_outputs, drafter):  # type: ignore[no-untyped-def]
    """A small random draft (its drafts mostly rejected) and the target as its own draft (every
    draft accepted, bonus tokens, accepted drafts' K/V reused): token for token the same."""
    from pagecast.runtime import LLM

    model = draft_artifact if drafter == "small" else tiny_llama_artifact
    config = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    llm = LLM(tiny_llama_artifact, max_num_seqs=4, speculative_config=config)
    assert generate(llm) == plain_outputs
    stats = llm.engine.core.spec_stats
    assert stats.num_draft_tokens > 0
    if drafter == "itself":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert stats.num_emitted_tokens > 3 * stats.num_verified  # k + 1 tokens a step, mostly


def test_an_artifact_built_with_a_draft_speculates_by_default(speculative_artifact, plain_outputs):  # type: ignore[no-untyped-def]
    from pagecast.runtime import LLM

    llm = LLM(speculative_artifact, max_num_seqs=4)  # the same target as tiny_llama_artifact, and its draft
    # The manifest's "speculative" is the directory inside the artifact, resolved against it.
    drafter = str(llm.engine.core.artifact.path / "speculative")
    assert llm.engine.core.speculative == SpeculativeConfig("draft_model", 3, drafter)
    assert generate(llm) == plain_outputs
    assert llm.engine.core.spec_stats.num_draft_tokens > 0


def test_preempted_and_prefix_sharing_requests_keep_their_drafts_right(tiny_llama_artifact):  # type: ignore[no-untyped-def]
    """With the target as its own draft every draft is right, as long as the proposer's K/V
    bookkeeping is: through preemptions (recomputed from position 0 in new blocks) and n = 2
    siblings sharing prompt blocks, every draft is accepted and the tokens are the plain ones."""
    from pagecast.runtime import LLM

    params = SamplingParams(n=2, temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [prompt(40 + i, 20) for i in range(2)]
    plain = LLM(tiny_llama_artifact, max_num_seqs=4, speculative_config="off")
    expected = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, params, use_tqdm=False)]
    block = plain.engine.core.artifact.memory_plan["bytes_per_block"]
    config = {"method": "draft_model", "model": str(tiny_llama_artifact), "num_speculative_tokens": 3}
    # 5 blocks (of target and draft K/V) for 4 sequences of 52 tokens (4 blocks each).
    tight = LLM(tiny_llama_artifact, max_num_seqs=4, speculative_config=config, kv_cache_memory=5 * 2 * block,
                max_model_len=80)  # fmt: skip
    out = tight.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in out] == expected
    core = tight.engine.core
    assert core.block_pool.num_blocks == 5 and core.scheduler.num_preemptions > 0
    assert core.spec_stats.num_draft_tokens > 0
    assert core.spec_stats.num_accepted_tokens == core.spec_stats.num_draft_tokens


def test_tensor_parallel_targets_and_drafts_are_refused(target_core, draft_checkpoint, tmp_path):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from conftest import build_artifact

    from pagecast.runtime.spec_draft import DraftModelProposer

    config = SpeculativeConfig("draft_model", model=str(tmp_path))
    tp_target = SimpleNamespace(artifact=SimpleNamespace(manifest=SimpleNamespace(tp=2), path=tmp_path))
    with pytest.raises(ValueError, match=r"not supported yet with tensor parallelism \(target tp 2.*--tp 1"):
        DraftModelProposer(config, tp_target)  # before loading any draft
    tp_draft = build_artifact(draft_checkpoint, tmp_path / "tp2", tp=2)
    with pytest.raises(ValueError, match=r"not supported yet with tensor parallelism \(target tp 1, draft tp 2\)"):
        proposer_for(target_core, tp_draft)


def test_served_with_the_artifacts_draft(speculative_artifact, plain_outputs):  # type: ignore[no-untyped-def]
    """engine-serve's engine (the core in its own process) loads the nested draft too: the same
    greedy tokens over HTTP, and drafts counted in /metrics."""
    httpx = pytest.importorskip("httpx")
    from server_support import make_engine, metric, metric_samples, serve

    engine = make_engine(speculative_artifact)
    with serve({"tiny": engine}) as server:
        for ids, expected in zip(E2E_PROMPTS[:2], plain_outputs[:2]):
            body = {"model": "tiny", "prompt": ids, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True,
                    "return_token_ids": True}  # fmt: skip
            reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
            assert reply["choices"][0]["token_ids"] == expected
        samples = metric_samples(server.url)
        assert metric(samples, "pagecast_spec_decode_num_draft_tokens_total", model_name="tiny") > 0


def test_a_draft_with_another_tokenizer_is_refused(target_core, tiny_llama_checkpoint, draft_checkpoint, tmp_path):  # type: ignore[no-untyped-def]
    """Same vocabulary size, another tokenizer (here: one that lowercases its input)."""
    import shutil

    from conftest import build_artifact

    from pagecast.runtime.errors import BuildError

    ckpt = shutil.copytree(draft_checkpoint, tmp_path / "ckpt")
    spec = json.loads((ckpt / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Lowercase"}
    (ckpt / "tokenizer.json").write_text(json.dumps(spec))
    other = build_artifact(ckpt, tmp_path / "draft")
    with pytest.raises(ValueError, match=r"its tokenizer \(tokenizer.json\) differs from the target's"):
        proposer_for(target_core, other)
    with pytest.raises(BuildError, match=r"its tokenizer \(tokenizer.json\) differs from the target's"):
        build_artifact(tiny_llama_checkpoint, tmp_path / "engine", speculative_config=draft_config(other))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"method": "replay"}', "replay is for benchmarks: give it to LLM / engine-serve"),
        ('{"method": "draft_model"}', "method draft_model needs model: a draft artifact"),
        ("{not json", "speculative_config is not valid JSON"),
    ],
)
def test_build_options_check_the_config(config: str, message: str) -> None:
    from pagecast.builder.ir import BuildOptions

    with pytest.raises(ValueError, match=message):
        BuildOptions(model="m", speculative_config=config)  # type: ignore[arg-type]
