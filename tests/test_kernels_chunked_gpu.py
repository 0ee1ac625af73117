"""Chunked attention (Llama 4) in both paged attention kernels on a GPU, in bf16 (the Triton
interpreter's bf16 dots are wrong, so tests/test_kernels_chunked.py checks fp32 and fp16 there),
against the torch reference."""

from __future__ import annotations

import pytest
import torch
from test_kernels import paged_inputs
from test_kernels_chunked import ref

from pagecast.kernels.paged_decode_attention import paged_decode_attention
from pagecast.kernels.paged_prefill_attention import paged_prefill_attention

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _cuda(x: dict) -> dict:
    return {k: v.cuda() for k, v in x.items()}


@pytest.mark.parametrize("chunk", [16, 100, 8192])
@pytest.mark.parametrize("config", [None, {"BLOCK_N": 64, "num_splits": 8}])
def test_decode_chunked_bf16(chunk, config):  # type: ignore[no-untyped-def]
    seq_lens = [1, 16, 17, 100, 101, 777, 8192, 8193, 9000]
    x = _cuda(paged_inputs(seq_lens, [1] * len(seq_lens), 32, 8, 128, 16, torch.bfloat16))
    out = paged_decode_attention(**x, scale=128**-0.5, max_seq_len=max(seq_lens), config=config, chunk=chunk)
    torch.testing.assert_close(out.float(), ref(x, 128**-0.5, chunk).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("chunk", [16, 100, 1024])
def test_prefill_chunked_bf16(chunk):  # type: ignore[no-untyped-def]
    seq_lens, q_lens = [300, 2100, 17, 1500], [300, 700, 17, 1]
    x = _cuda(paged_inputs(seq_lens, q_lens, 32, 8, 128, 16, torch.bfloat16))
    out = paged_prefill_attention(**x, scale=128**-0.5, chunk=chunk)
    torch.testing.assert_close(out.float(), ref(x, 128**-0.5, chunk).float(), atol=2e-2, rtol=2e-2)
