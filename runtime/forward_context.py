"""What one forward pass needs besides token ids and positions: the attention metadata.

Built by the model runner per step and read by the generated model code. Tensors live on
the model's device; for CUDA graphs they are slices of persistent buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V goes to, -1 = none
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32: each sequence's block ids
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: where each sequence's tokens start
    max_query_len: int  # 1 for a pure decode batch: kernels pick the decode path from it
    max_seq_len: int  # longest context, for grid sizing
    logits_indices: torch.Tensor  # [num_logits] int64: rows of the hidden states to project to logits
    # Leading sequences with one query token each (decodes, which the scheduler puts first) of a
    # mixed batch: the decode kernel may take them and the prefill kernel the rest
    # (ops.paged_attention). 0 in a decode-only batch, which needs no count.
    num_decodes: int = 0


def leading_decodes(num_scheduled_tokens: list[int]) -> int:
    """How many sequences at the front of a step's batch have one new token each."""
    n = 0
    for tokens in num_scheduled_tokens:
        if tokens != 1:
            break
        n += 1
    return n
