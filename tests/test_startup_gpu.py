"""Start-up on a GPU (run with `pytest -m gpu` on the accelerator): an engine started from a built
artifact compiles no Triton kernel, neither at start nor while it serves every sampling feature
(tests/test_startup_compiles.py checks the variant sets on the CPU)."""

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

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# A fresh process (its Triton has compiled nothing) whose Triton cache is the artifact's: starts the
# engine (graphs captured at start, or lazily), serves every sampling feature in both scheduling
# modes, all at once and one by one, and prints the kernels Triton compiled at start and while
# serving.
SERVE_EVERY_FEATURE = """
import json, sys
sys.path.insert(0, sys.argv[2])
from test_startup_compiles import every_feature
from pagecast.runtime import LLM
from pagecast.runtime.kernel_cache import TritonCompiles

compiles = TritonCompiles()
at_start, while_serving = [], []
for mode in (False, True):
    before = compiles.count
    llm = LLM(sys.argv[1], async_scheduling=mode, max_num_seqs=32, kv_cache_memory="256MiB",
              lazy_graphs=sys.argv[3] == "lazy")
    at_start += compiles.names[before:]
    before = compiles.count
    requests = every_feature()
    llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    for prompt, params in requests:
        llm.generate([prompt], params, use_tqdm=False)
    while_serving += compiles.names[before:]
    del llm
print(json.dumps({"details": compiles.details}))
print(json.dumps({"at_start": at_start, "while_serving": while_serving}))
"""


# Llama-3's vocabulary (1,002 blocks of 128) and an odd one; lazy graphs: decode batches run eagerly
# at their own sizes (not padded to a graph's) until their graph is captured.
@pytest.mark.parametrize(("vocab", "graphs"), [(128_256, "eager"), (3001, "eager"), (128_256, "lazy")])
def test_serving_every_sampling_feature_compiles_nothing(tmp_path: Path, vocab: int, graphs: str) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", tokenizer=False, vocab_size=vocab)
    _assert_serving_compiles_nothing(ckpt, tmp_path / "art", graphs)


# Each a constexpr the tuner once launched only one way, so serving compiled the other
# (tests/test_tuned_variants.py checks the tuner's launches on the CPU): Qwen2's qkv bias, Qwen3's
# per-head q/k norms, OLMo2's whole-projection q/k norms, a partial rotary width, and GPTQ act-order
# int4 projections (their input perm) with a bias.
FAMILY_VARIANTS = {
    "qwen2-bias": ("qwen2", {}, None),
    "qwen3-qk-norm": ("qwen3", {}, None),
    "olmo2-projection-norm": ("olmo2", {}, None),
    "llama-partial-rotary": ("llama", {"partial_rotary_factor": 0.5}, None),
    "qwen2-gptq-act-order": ("qwen2", {}, "gptq-act-order"),
}


@pytest.mark.parametrize("variant", list(FAMILY_VARIANTS))
def test_model_variants_compile_nothing_while_serving(tmp_path: Path, variant: str) -> None:
    family, overrides, quant = FAMILY_VARIANTS[variant]
    ckpt = make_checkpoint(tmp_path / "ckpt", family, tokenizer=False, **overrides)
    if quant is not None:
        from quant_writer import Format, write

        ckpt, _ = write(ckpt, tmp_path / "q", Format("gptq", 32, sym=True, desc_act=True))
    _assert_serving_compiles_nothing(ckpt, tmp_path / "art", "eager")


def _assert_serving_compiles_nothing(ckpt: Path, out: Path, graphs: str) -> None:
    """Build ``ckpt`` on this GPU, serve every sampling feature in a fresh process whose Triton
    cache is the artifact's, and assert nothing compiled, at start or while serving."""
    from pagecast.runtime.kernel_cache import TritonCompiles

    built = TritonCompiles()  # what the build compiles into the artifact, to compare on failure
    art = build_artifact(ckpt, out, gpu="auto", dtype="bfloat16", tune_budget_s=10.0)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", SERVE_EVERY_FEATURE, str(art), str(Path(__file__).parent), graphs],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    compiled = json.loads(lines[-1])
    served = json.loads(lines[-2])["details"]
    names = {d["name"] for d in served}
    # On failure: each variant compiled while serving, then the build's variants of those kernels
    # (the arguments whose alignment or divisibility differs are the cause).
    # The build compiles in a subprocess (builder/tune.py), so its variants are read from the
    # artifact's cache: each compile's metadata (hash, target, options) beside its binary.
    cached = [
        {k: v for k, v in json.loads(f.read_text()).items() if k in ("name", "hash", "target", "num_warps", "num_stages", "debug")}
        for name in names for f in sorted((art / "triton_cache").glob(f"*/{name}.json"))
    ]  # fmt: skip
    explain = "\n".join(
        [f"served: {d}" for d in served]
        + [f"built: {d}" for d in built.details if d["name"] in names]
        + [f"in the artifact's cache: {c}" for c in cached]
    )
    assert compiled == {"at_start": [], "while_serving": []}, explain


def test_lazy_graphs_serve_before_capture_and_give_the_same_tokens(tmp_path: Path) -> None:
    from pagecast.runtime import LLM, SamplingParams

    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", tokenizer=False)
    art = build_artifact(ckpt, tmp_path / "art", gpu="auto", dtype="float32", tune_budget_s=10.0)
    prompts = [[1 + (i * 37 + j * 11) % 4000 for j in range(n)] for i, n in enumerate([5, 17, 33, 64, 3, 9])]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for lazy in (False, True):
        llm = LLM(art, lazy_graphs=lazy, max_num_seqs=8, kv_cache_memory="256MiB")
        graphs = llm.engine.runner.graphs
        assert graphs is not None
        if lazy:
            assert graphs.pending and not graphs.graphs  # serving before any graph is captured
        outputs[lazy] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        if lazy:
            assert graphs.graphs  # the decode steps captured the graphs of their own buckets
            while llm.engine.runner.capture_while_idle():  # the rest, as an idle engine-core does
                pass
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == outputs[lazy]
        assert graphs.pending == 0 and graphs.graphs
        del llm
        torch.cuda.empty_cache()
    assert outputs[True] == outputs[False]
