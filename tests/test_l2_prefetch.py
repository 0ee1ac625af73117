"""The L2 prefetch of the o projection (kernels/l2_prefetch.py, experimental, built with
PAGECAST_L2_PREFETCH=1): the rendered model asks for each layer's o weight right after its qkv
projection and joins before the attention, small steps only; nothing happens where the artifact was
built without it, on the CPU, or past MAX_ROWS rows; the choice travels from the build's table to
serving. (Its kernel compiled for sm_90: tests/test_l2_prefetch_compile_sm90.py.)"""

from __future__ import annotations

import pytest
import torch

from pagecast.kernels import l2_prefetch, ops
from pagecast.kernels.quant_linear import Fp8LinearWeight, Int4LinearWeight


def test_each_layer_prefetches_its_o_weight_after_qkv_and_joins_before_attention(
    tiny_llama_artifact, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    from pagecast.runtime import LLM, SamplingParams

    llm = LLM(tiny_llama_artifact)
    model = llm.engine.runner.model
    calls: list[tuple] = []
    real_fork = l2_prefetch.fork
    monkeypatch.setattr(
        l2_prefetch, "fork", lambda rows, *w: (calls.append(("fork", rows, w)), real_fork(rows, *w))
    )
    monkeypatch.setattr(l2_prefetch, "join", lambda: calls.append(("join",)))
    attention = model.attention
    monkeypatch.setattr(
        model,
        "attention",
        lambda i, q, ctx, out=None: (calls.append(("attention", i)), attention(i, q, ctx, out))[1],
    )
    prompt = [5, 17, 42, 8]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    layers = len(model.layers)
    expected = [
        call
        for i in range(layers)
        for call in (("fork", len(prompt), (model.layers[i][5],)), ("join",), ("attention", i))
    ]
    assert calls[: 3 * layers] == expected  # the prompt's step: every layer, its own o weight
    assert calls[3 * layers] == ("fork", 1, (model.layers[0][5],))  # then a one-row decode step
    assert not l2_prefetch._forked  # nothing forked: the CPU runtime never enables it


def test_fork_does_nothing_when_off_past_max_rows_or_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    launched = []
    monkeypatch.setattr(l2_prefetch, "launch", launched.append)
    w = torch.randn(64, 64)
    monkeypatch.setattr(l2_prefetch.OPTION, "on", False)
    l2_prefetch.fork(1, w)
    monkeypatch.setattr(l2_prefetch.OPTION, "on", True)
    l2_prefetch.fork(l2_prefetch.MAX_ROWS + 1, w)
    l2_prefetch.fork(1, w)  # a CPU tensor: no copy engine to ask
    l2_prefetch.join()
    assert launched == [] and not l2_prefetch._forked


def test_every_tensor_of_a_quantised_weight_is_prefetched() -> None:
    fp8 = Fp8LinearWeight(torch.zeros(8, 16).to(torch.float8_e4m3fn), torch.ones(8), None, "token")
    assert [
        t is u for t, u in zip(l2_prefetch.tensors_of(fp8), [fp8.weight, fp8.weight_scale], strict=True)
    ] == [True, True]
    int4 = Int4LinearWeight(
        torch.zeros(2, 8, dtype=torch.int32), torch.ones(1, 8), torch.zeros(1, 8, dtype=torch.int8), None, 16
    )
    int4._dense[torch.float32] = torch.zeros(16, 8)  # the CPU path's cache: not a weight the kernel reads
    got = l2_prefetch.tensors_of(int4)
    assert len(got) == 3 and all(
        a is b for a, b in zip(got, [int4.qweight, int4.scales, int4.zeros], strict=True)
    )
    w = torch.zeros(4, 4)
    assert l2_prefetch.tensors_of(w)[0] is w and l2_prefetch.tensors_of(None) == []


def test_the_tuning_table_carries_the_prefetch_to_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.configure(..., l2_prefetch=...) (the loader passes the table's "l2_prefetch") switches it on
    for a GPU engine only, and activating another engine's table switches it back; the build's
    PAGECAST_L2_PREFETCH accepts 1 and 0 only."""
    monkeypatch.setattr(l2_prefetch.OPTION, "on", False)
    on = ops.configure({}, use_triton=True, l2_prefetch=True)
    assert l2_prefetch.enabled()
    off = ops.configure({}, use_triton=True)
    assert not l2_prefetch.enabled()
    ops.activate(on)
    assert l2_prefetch.enabled()
    ops.configure({}, use_triton=False, l2_prefetch=True)  # a CPU artifact
    assert not l2_prefetch.enabled()
    ops.activate(off)

    monkeypatch.setenv("PAGECAST_L2_PREFETCH", "1")  # (tests/test_pdl.py: how the value reads)
    assert l2_prefetch.requested()
    monkeypatch.setenv("PAGECAST_L2_PREFETCH", "maybe")
    with pytest.raises(ValueError, match="PAGECAST_L2_PREFETCH must be 1 or 0"):
        l2_prefetch.requested()


def test_a_build_without_the_gpu_says_the_options_asked_for_are_ignored_and_refuses_a_bad_value(
    tmp_path, tiny_llama_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    import json

    from conftest import build_artifact

    from pagecast.runtime.errors import BuildError

    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    monkeypatch.setenv("PAGECAST_PDL", "1")
    monkeypatch.setenv("PAGECAST_L2_PREFETCH", "1")
    art = build_artifact(tiny_llama_checkpoint, tmp_path / "art", gpu="h200", load_format="dummy")
    note = (art / "report.md").read_text()
    assert "PAGECAST_PDL=1 ignored: programmatic dependent launch is built on the GPU" in note
    assert "PAGECAST_L2_PREFETCH=1 ignored: the bulk L2 prefetch is built on the GPU" in note
    assert not json.loads((art / "tuning.json").read_text()).get("l2_prefetch")
    monkeypatch.setenv("PAGECAST_L2_PREFETCH", "maybe")
    with pytest.raises(BuildError, match="PAGECAST_L2_PREFETCH must be 1 or 0"):
        build_artifact(tiny_llama_checkpoint, tmp_path / "bad", gpu="h200", load_format="dummy")
