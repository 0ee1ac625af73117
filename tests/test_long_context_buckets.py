"""Long-context decode buckets (issue 32), on the CPU: the decode kernel is tuned at a 131072
context bucket only for models past 32k, timed at max_model_len where that is shorter; the decode
CUDA graphs keep a 32k context level below a 128k model's own, so its 8k-32k contexts replay
the 32k bucket's split count (runtime/cuda_graphs.py, CONTEXT_BUCKETS)."""

from __future__ import annotations

import pytest
import torch

from pagecast.kernels import problems, tuning
from pagecast.runtime.cuda_graphs import DecodeGraphs

LLAMA = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "hidden": 4096, "intermediate": 14336, "block_size": 16}


def _decode_buckets(max_model_len: int) -> dict[str, dict[str, int]]:
    shapes = tuning.ModelShapes(**LLAMA, max_model_len=max_model_len, max_num_seqs=1)
    return dict(problems.buckets("paged_decode_attention", shapes))


def test_the_128k_decode_bucket_only_past_32k():
    at_32k = _decode_buckets(32768)
    assert list(at_32k) == ["1x512", "1x2048", "1x8192", "1x32768"]
    assert at_32k["1x32768"] == {"num_seqs": 1, "max_seq_len": 32768}
    # 40k: a 131072 bucket, timed at the model's 40,960 (it serves contexts 32k-40k)
    at_40k = _decode_buckets(40960)
    assert list(at_40k) == ["1x512", "1x2048", "1x8192", "1x32768", "1x131072"]
    assert at_40k["1x131072"] == {"num_seqs": 1, "max_seq_len": 40960}
    assert _decode_buckets(131072)["1x131072"] == {"num_seqs": 1, "max_seq_len": 131072}
    # each name is the bucket serving computes for the longest context it is timed at
    for buckets in (at_32k, at_40k):
        assert all(tuning.decode_bucket(d["num_seqs"], d["max_seq_len"]) == b for b, d in buckets.items())


@pytest.mark.parametrize(
    "max_model_len, contexts",
    [
        (131072, [2048, 8192, 32768, 131072]),
        (40960, [2048, 8192, 32768, 40960]),
        (32768, [2048, 8192, 32768]),
        (16384, [2048, 8192, 16384]),
    ],
)
def test_decode_graph_context_levels(max_model_len, contexts):  # type: ignore[no-untyped-def]
    graphs = DecodeGraphs(None, torch.device("cpu"), [1, 8], max_model_len, 16)
    assert graphs.contexts == contexts
    assert graphs.max_blocks == max_model_len // 16
    # captured largest first (the first capture sizes the shared memory pool)
    assert graphs._plan[:2] == [(8, max_model_len), (1, max_model_len)] and len(graphs._plan) == 2 * len(contexts)
