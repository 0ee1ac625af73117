"""EAGLE-3 speculative decoding (issue 31): the head's checkpoint, its conversion and its drafts.

A tiny random EAGLE-3 head in the published layout (tests/eagle3_heads.py) is made for the tiny
Llama target. Its drafts from the paged proposer (runtime/spec_eagle.py), fed by the features the
artifact's generated model copies out, must equal those of a plain-torch head written here from
the method's definition (full-sequence attention, no cache), fed by transformers' hidden_states of
the same target checkpoint.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from eagle3_heads import HEAD, TARGET_DIMS, make_echo_head, make_head

from pagecast.builder.eagle3 import convert_eagle3_head
from pagecast.runtime.eagle3_head import HEAD_CONFIG, default_aux_layer_ids, read_eagle3_head

# -- the reference: EAGLE-3's head from its definition -----------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """transformers' Llama rotary (rotate_half) at positions 0..len - 1; x: [len, heads, d]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angles = torch.arange(x.shape[0]).float()[:, None] * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def reference_layer(  # type: ignore[no-untyped-def]
    w: dict[str, torch.Tensor], embed: torch.Tensor, tokens: list[int], hidden: torch.Tensor, norm_first: bool
):
    """The head over a whole sequence (row i: position i, token ``tokens[i]``, feature
    ``hidden[i]``): (pre-norm outputs, draft-vocabulary logits). ``norm_first``: the config's
    norm_before_residual (the residual is the normed feature)."""
    p, d = "midlayer.", HEAD["head_dim"]
    n = len(tokens)
    e = _rms(embed[torch.tensor(tokens)], w[p + "input_layernorm.weight"])
    normed = _rms(hidden, w[p + "hidden_norm.weight"])
    x = torch.cat([e, normed], -1)
    q = _rope((x @ w[p + "self_attn.q_proj.weight"].T).view(n, -1, d), 10000.0)
    k = _rope((x @ w[p + "self_attn.k_proj.weight"].T).view(n, -1, d), 10000.0)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, -1, d)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    residual = (normed if norm_first else hidden) + attn @ w[p + "self_attn.o_proj.weight"].T
    x = _rms(residual, w[p + "post_attention_layernorm.weight"])
    mlp = (
        torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
    ) @ w[p + "mlp.down_proj.weight"].T
    out = residual + mlp
    return out, _rms(out, w["norm.weight"]) @ w["lm_head.weight"].T


def reference_drafts(
    w: dict[str, torch.Tensor],
    embed: torch.Tensor,
    aux: torch.Tensor,
    tokens: list[int],
    k: int,
    norm_first: bool = False,
) -> list[int]:
    """k greedy drafts after ``tokens`` (t_0..t_{n-1}), ``aux`` [n - 1, 3 * hidden] the target's
    features at positions 0..n-2: row i reads t_{i+1} and fc(aux_i); each draft's row reads the
    draft and the previous row's pre-norm output. Recomputed from scratch at every step."""
    inputs, hidden = list(tokens[1:]), aux @ w["fc.weight"].T
    d2t = w["d2t"]
    drafts: list[int] = []
    for _ in range(k):
        out, logits = reference_layer(w, embed, inputs, hidden, norm_first)
        best = int(logits[-1].argmax())
        drafts.append(best + int(d2t[best]))
        inputs.append(drafts[-1])
        hidden = torch.cat([hidden, out[-1:]])
    return drafts


def hf_aux(hf, tokens: list[int], layer_ids: tuple[int, ...]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """transformers' features for positions 0..n-2: hidden_states[L] is the stream entering layer L."""
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0, : len(tokens) - 1] for i in layer_ids], -1)


# -- the paged proposer, fed by the artifact's generated model ----------------------------------


@dataclass
class FakeRequest:
    """What Eagle3Proposer reads of a Request."""

    request_id: str
    all_token_ids: list[int]
    block_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class Target:
    """The artifact's model with its KV cache and an Eagle3Proposer bound, run one request at a
    time the way the engine would (K/V written at the request's blocks' slots)."""

    def __init__(self, artifact: Path, head_dir: Path, num_blocks: int = 24):
        from types import SimpleNamespace

        from pagecast.kernels import ops
        from pagecast.runtime.loader import load_artifact
        from pagecast.runtime.spec_eagle import Eagle3Proposer
        from pagecast.runtime.speculative import SpeculativeConfig

        art = load_artifact(artifact, load_tokenizer=False)
        art.wait_verified()
        m = art.manifest
        self.art, self.block_size = art, m.block_size
        kv = torch.zeros(
            (m.dims["num_layers"], 2, num_blocks, m.kv_heads_per_rank, m.block_size, m.dims["head_dim"])
        )
        art.model.bind_kv_cache(kv)
        ops.activate(art.kernels)
        core = SimpleNamespace(artifact=art, block_size=m.block_size, max_model_len=m.max_model_len)
        self.proposer = Eagle3Proposer(SpeculativeConfig(method="eagle3", model=str(head_dir)), core)
        self.proposer.bind_kv_cache(num_blocks)

    def slots(self, request: FakeRequest, start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor([request.block_ids[p // bs] * bs + p % bs for p in range(start, end)])

    def run(self, request: FakeRequest, start: int, end: int) -> torch.Tensor:
        """The target over positions [start, end) of the request: its final hidden states."""
        from pagecast.runtime.forward_context import ForwardContext

        n = end - start
        ctx = ForwardContext(
            slot_mapping=self.slots(request, start, end),
            block_tables=torch.tensor([request.block_ids], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            max_query_len=n,
            max_seq_len=end,
            logits_indices=torch.arange(n),
        )
        ids = torch.tensor(request.all_token_ids[start:end])
        return self.art.model.forward(ids, torch.arange(start, end), ctx)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def hf_target(tiny_llama_checkpoint):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_checkpoint), dtype=torch.float32).eval()


def _weights(head_dir: Path) -> dict[str, torch.Tensor]:
    return read_eagle3_head(head_dir, TARGET_DIMS).weights


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(
        3, TARGET_DIMS["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def test_aux_buffer_holds_transformers_hidden_states_and_leaves_the_forward_unchanged(
    tiny_llama_artifact, hf_target, tmp_path
):  # type: ignore[no-untyped-def]
    head = make_head(tmp_path / "head")
    target = Target(tiny_llama_artifact, head)
    request = FakeRequest("a", _tokens(1, 37), [5, 2, 9])
    with_aux = target.run(request, 0, 36)
    layers = default_aux_layer_ids(3)
    assert layers == (0, 1, 2)
    slots = target.slots(request, 0, 36)
    got = target.proposer.aux[:, slots].transpose(0, 1).reshape(36, -1)
    torch.testing.assert_close(got, hf_aux(hf_target, request.all_token_ids, layers), atol=2e-5, rtol=1e-4)
    # The copy is a side output only: the same forward without it gives the same hidden states.
    target.art.model.bind_aux_hidden_states(None, [])
    torch.testing.assert_close(target.run(request, 0, 36), with_aux, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("own_embedding", "norm_first"),
    [(False, False), (True, False), (False, True)],
    ids=["shared-embedding", "own-embedding", "norm-before-residual"],
)
def test_drafts_equal_the_reference_head_with_catch_up(
    tiny_llama_artifact, hf_target, tmp_path, own_embedding, norm_first
):  # type: ignore[no-untyped-def]
    head = make_head(tmp_path / "head", own_embedding=own_embedding, norm_before_residual=norm_first, seed=3)
    w = _weights(head)
    embed = w["embed_tokens.weight"] if own_embedding else hf_target.model.embed_tokens.weight.detach()
    target = Target(tiny_llama_artifact, head)
    a = FakeRequest("a", _tokens(2, 21), [7, 3, 11, 0])
    b = FakeRequest("b", _tokens(3, 34), [1, 12, 4, 8])
    c = FakeRequest("c", _tokens(4, 9), [6, 10])
    for r in (a, b, c):
        target.run(r, 0, r.num_tokens - 1)  # the engine's state at propose: all but the last token computed

    def expected(r: FakeRequest, k: int) -> list[int]:
        aux = hf_aux(hf_target, r.all_token_ids, (0, 1, 2))
        return reference_drafts(w, embed, aux, r.all_token_ids, k, norm_first)

    drafts = target.proposer.propose([a, b, c], [3, 2, 0])
    assert drafts == [expected(a, 3), expected(b, 2), []]
    assert all(len(set(d)) >= 1 for d in drafts[:2])

    # More tokens: a gets five (the target computes them in one chunk, say a verification pass
    # that accepted drafts), b one, c none yet but its first drafts now. The head catches up
    # from the features the target left in the buffer, whatever steps computed them.
    a.all_token_ids += _tokens(5, 5)
    b.all_token_ids += _tokens(6, 1)
    target.run(a, 20, a.num_tokens - 1)
    target.run(b, 33, b.num_tokens - 1)
    drafts = target.proposer.propose([a, b, c], [4, 1, 2])
    assert drafts == [expected(a, 4), expected(b, 1), expected(c, 2)]

    # Preempted and recomputed in other blocks: after drop the head starts over from position 0.
    target.proposer.drop({"a"})
    a.block_ids = [13, 14, 15, 16]
    target.run(a, 0, a.num_tokens - 1)
    assert target.proposer.propose([a], [3]) == [expected(a, 3)]


def test_raw_and_converted_heads_draft_alike(tiny_llama_artifact, tmp_path):  # type: ignore[no-untyped-def]
    raw = make_head(tmp_path / "raw", seed=5, weights_format="bin", rope_theta=None)  # rope: the target's
    summary = convert_eagle3_head(raw, tmp_path / "converted", TARGET_DIMS)
    assert summary["draft_vocab_size"] == HEAD["draft_vocab"]
    assert summary["aux_layer_ids"] == [0, 1, 2]
    assert summary["embedding"] == "shared with the target"
    assert sorted(p.name for p in (tmp_path / "converted").iterdir()) == sorted(summary["files"])
    assert json.loads((tmp_path / "converted" / HEAD_CONFIG).read_text())["config"]["rope"] is None
    request = FakeRequest("r", _tokens(7, 26), [3, 1])
    results = []
    for head in (raw, tmp_path / "converted"):
        target = Target(tiny_llama_artifact, head)
        target.run(request, 0, request.num_tokens - 1)
        results.append(target.proposer.propose([request], [4]))
    assert results[0] == results[1]
    assert len(results[0][0]) == 4


def test_kv_bytes_per_block_counts_the_head_cache_and_the_features(tiny_llama_artifact, tmp_path):  # type: ignore[no-untyped-def]
    target = Target(tiny_llama_artifact, make_head(tmp_path / "head"))
    bs = target.block_size
    # fp32: the head's K and V (2 KV heads of 24) and three features of 96 per slot
    assert target.proposer.kv_bytes_per_block == bs * 4 * (2 * 2 * 24 + 3 * 96)


def test_explicit_aux_layers_are_read_from_the_config(tmp_path):  # type: ignore[no-untyped-def]
    head = read_eagle3_head(make_head(tmp_path / "head", aux_layer_ids=[2, 0, 1]), TARGET_DIMS)
    assert head.config.aux_layer_ids == (0, 1, 2)
    with pytest.raises(ValueError, match=r"auxiliary hidden-state layers \[0, 1, 5\]"):
        read_eagle3_head(make_head(tmp_path / "bad", aux_layer_ids=[0, 1, 5]), TARGET_DIMS)


def test_conversion_errors_name_the_key_and_the_mismatch(tmp_path):  # type: ignore[no-untyped-def]
    # A head trained for a target of hidden 64 (its fc reads 3 x 64), given a target of 96.
    wrong = make_head(tmp_path / "wrong-hidden", target_hidden=64)
    with pytest.raises(ValueError, match="target of hidden size 64; this target's is 96"):
        convert_eagle3_head(wrong, tmp_path / "out1", TARGET_DIMS)
    # ... and one whose config does not say so: the fc shape gives it away.
    cfg = json.loads((wrong / "config.json").read_text())
    del cfg["target_hidden_size"]
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"fc.weight has shape \(96, 192\), expected \(96, 288\)"):
        convert_eagle3_head(wrong, tmp_path / "out2", TARGET_DIMS)
    missing = make_head(tmp_path / "missing", drop=("midlayer.hidden_norm.weight",))
    with pytest.raises(ValueError, match="lack midlayer.hidden_norm.weight"):
        convert_eagle3_head(missing, tmp_path / "out3", TARGET_DIMS)
    with pytest.raises(ValueError, match="vocab_size 49152 is not the target's 32000"):
        convert_eagle3_head(
            make_head(tmp_path / "ok"), tmp_path / "out4", {**TARGET_DIMS, "vocab_size": 32000}
        )
    not_eagle = make_head(tmp_path / "llama")
    cfg = json.loads((not_eagle / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (not_eagle / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="name no EAGLE-3 head"):
        convert_eagle3_head(not_eagle, tmp_path / "out5", TARGET_DIMS)
    del cfg["intermediate_size"]
    (not_eagle / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLMEagle3"]}))
    with pytest.raises(ValueError, match="config.json lacks intermediate_size"):
        convert_eagle3_head(not_eagle, tmp_path / "out6", TARGET_DIMS)
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out3").exists()


def test_chunked_catch_up_and_uneven_draft_counts(tiny_llama_artifact, hf_target, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """A long catch-up runs in chunks (here of 5 positions) and requests wanting different numbers
    of drafts leave the draft steps one by one; the drafts are the reference's all the same."""
    from pagecast.runtime import spec_eagle

    monkeypatch.setattr(spec_eagle, "CATCH_UP_CHUNK", 5)
    head = make_head(tmp_path / "head", seed=11)
    w = _weights(head)
    embed = hf_target.model.embed_tokens.weight.detach()
    target = Target(tiny_llama_artifact, head)
    requests = [
        FakeRequest("long", _tokens(8, 31), [2, 0]),
        FakeRequest("short", _tokens(9, 2), [5]),  # one prompt token computed: one catch-up row
        FakeRequest("mid", _tokens(10, 12), [9]),
    ]
    for r in requests:
        target.run(r, 0, r.num_tokens - 1)
    drafts = target.proposer.propose(requests, [2, 4, 3])
    assert drafts == [
        reference_drafts(w, embed, hf_aux(hf_target, r.all_token_ids, (0, 1, 2)), r.all_token_ids, k)
        for r, k in zip(requests, [2, 4, 3])
    ]


def test_echo_head_drafts_the_repeated_token(tiny_llama_artifact, hf_target, tmp_path):  # type: ignore[no-untyped-def]
    """The end-to-end test's accepting head, checked here: a head without d2t (the draft
    vocabulary is the target's) whose drafts on a run of one token are that token."""
    embed = hf_target.model.embed_tokens.weight.detach()
    head = make_echo_head(tmp_path / "echo", embed)
    assert read_eagle3_head(head, TARGET_DIMS).weights["d2t"].count_nonzero() == 0
    target = Target(tiny_llama_artifact, head)
    r = FakeRequest("r", _tokens(12, 9) + [777] * 4, [4])
    target.run(r, 0, r.num_tokens - 1)
    drafts = target.proposer.propose([r], [3])
    assert drafts == [[777, 777, 777]]
    w = _weights(head)
    assert drafts[0] == reference_drafts(
        w, embed, hf_aux(hf_target, r.all_token_ids, (0, 1, 2)), r.all_token_ids, 3
    )


@pytest.mark.parametrize("family", ["llama", "olmo2", "gemma2", "granite", "qwen3_moe"])
def test_every_family_copies_the_stream_entering_each_layer(
    family, tiny_artifact_factory, tiny_checkpoint_factory
):  # type: ignore[no-untyped-def]
    """The generated model's copy is transformers' hidden_states[L] for every layer L, whatever
    the layer's norms (none before attention: OLMo 2), multipliers (Granite, Gemma 2) or MLP
    (MoE), written at each token's slot across a prefill chunk and a decode step."""
    from transformers import AutoModelForCausalLM

    from pagecast.kernels import ops
    from pagecast.runtime.forward_context import ForwardContext
    from pagecast.runtime.loader import load_artifact

    art = load_artifact(tiny_artifact_factory(family), load_tokenizer=False)
    art.wait_verified()
    m = art.manifest
    bs, num_layers, num_blocks = m.block_size, m.dims["num_layers"], 8
    kv = torch.zeros((num_layers, 2, num_blocks, m.kv_heads_per_rank, bs, m.dims["head_dim"]))
    art.model.bind_kv_cache(kv)
    ops.activate(art.kernels)
    aux = torch.zeros((num_layers, num_blocks * bs + 1, m.dims["hidden_size"]))
    art.model.bind_aux_hidden_states(aux, list(range(num_layers)))
    tokens = _tokens(13, 2 * bs + 3)
    blocks = [4, 1, 6]
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(len(tokens))])
    for start, end in ((0, len(tokens) - 1), (len(tokens) - 1, len(tokens))):
        ctx = ForwardContext(
            slot_mapping=slots[start:end],
            block_tables=torch.tensor([blocks], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            max_query_len=end - start,
            max_seq_len=end,
            logits_indices=torch.arange(end - start),
        )
        art.model.forward(torch.tensor(tokens[start:end]), torch.arange(start, end), ctx)
    hf = AutoModelForCausalLM.from_pretrained(
        str(tiny_checkpoint_factory(family)), dtype=torch.float32, attn_implementation="eager"
    ).eval()  # eager: transformers' sdpa path drops Gemma 2's attention soft-cap
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    for layer in range(num_layers):
        want = states[layer][0]
        torch.testing.assert_close(aux[layer, slots], want, atol=1e-4 * float(want.abs().max()), rtol=1e-4)
    assert aux[:, -1].abs().sum() == 0  # the spare row: no token went there


# -- end to end: LLM speculating with the head -------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "echo"])
def test_llm_with_eagle3_gives_the_greedy_outputs_of_plain_decoding(
    tiny_llama_artifact, hf_target, tmp_path, monkeypatch, kind
):  # type: ignore[no-untyped-def]
    """LLM(..., speculative_config={"method": "eagle3", "model": HEAD_DIR}) with a raw head
    directory: greedy outputs equal those without speculation, token for token, over a batch
    with a prompt prefilled in chunks; every draft the head made inside the engine is the
    reference head's for the tokens the request had then; the echo head's drafts are accepted."""
    from pagecast.runtime import LLM, SamplingParams, spec_eagle

    embed = hf_target.model.embed_tokens.weight.detach()
    head = (
        make_echo_head(tmp_path / "echo", embed)
        if kind == "echo"
        else make_head(tmp_path / "random", seed=21)
    )
    w = _weights(head)
    calls: list[tuple[list[int], int, list[int]]] = []
    propose = spec_eagle.Eagle3Proposer.propose

    def recording(self, requests, num_drafts):  # type: ignore[no-untyped-def]
        drafts = propose(self, requests, num_drafts)
        calls.extend((list(r.all_token_ids), k, d) for r, k, d in zip(requests, num_drafts, drafts))
        return drafts

    monkeypatch.setattr(spec_eagle.Eagle3Proposer, "propose", recording)
    prompts = [_tokens(30 + i, n) for i, n in enumerate((5, 23, 40))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    options = {"max_num_batched_tokens": 32, "max_num_seqs": 4}  # the 40-token prompt prefills in chunks
    plain = LLM(tiny_llama_artifact, **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(
        tiny_llama_artifact,
        speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
        **options,
    )
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert calls, "the engine never asked the head for drafts"
    for tokens, k, drafts in calls:
        aux = hf_aux(hf_target, tokens, (0, 1, 2))
        assert drafts == reference_drafts(w, embed, aux, tokens, k)
    stats = llm.engine.core.stats()
    assert stats.spec_num_draft_tokens == sum(len(d) for _, _, d in calls)
    if kind == "echo":
        assert stats.spec_num_accepted_tokens >= 6


def test_llm_refuses_a_head_for_another_target_and_an_artifact_without_the_feature_copy(
    tiny_llama_artifact, tmp_path
):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from pagecast.runtime import LLM
    from pagecast.runtime.spec_eagle import Eagle3Proposer
    from pagecast.runtime.speculative import SpeculativeConfig

    wrong = make_head(tmp_path / "wrong", target_hidden=64)
    with pytest.raises(ValueError, match="target of hidden size 64; this target's is 96"):
        LLM(tiny_llama_artifact, speculative_config={"method": "eagle3", "model": str(wrong)})
    # An artifact rendered before the template could copy features out: rebuild, it says.
    old_model = SimpleNamespace(embed_tokens=torch.zeros(1))
    manifest = SimpleNamespace(tp=1, dims=TARGET_DIMS)
    core = SimpleNamespace(
        artifact=SimpleNamespace(model=old_model, manifest=manifest, path=tmp_path), block_size=16
    )
    config = SpeculativeConfig(method="eagle3", model=str(make_head(tmp_path / "head")))
    with pytest.raises(ValueError, match="built before EAGLE-3 support.*rebuild it"):
        Eagle3Proposer(config, core)
