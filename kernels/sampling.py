"""Sampling and logprobs in one streaming pass over each row of logits.

The sampler's per-token work used to be a dozen full-vocabulary torch passes (an fp32 copy,
temperature, masks, softmax, a noise tensor, a divide, an argmax; log_softmax, a gather and a
comparison for logprobs). Here each of the three full-row jobs reads the logits once, in their
own dtype, and keeps nothing per token:

- ``race``: the exponential race ``argmax(p / E)`` of the sampler. ``x = logit / temperature``,
  truncation is a per-row cutoff (see ``reference.truncation_keep``), ``p = exp(x - row_max)``,
  min-p drops ``p < min_p``, and ``E`` is the keyed Philox Exp(1) noise of
  ``kernels/keyed_noise.py`` drawn in the kernel, only in chunks that hold a kept token.
- ``count_ties``: how many tokens of a row have ``x`` equal to its cutoff (top-p needs the size
  of the tie group at the k-th value when it reaches past the top-k candidates).
- ``logprob_stats``: the row's max, ``sum(exp(logit - max))`` and how many logits are strictly
  greater than the scored token's: logsumexp and rank without a log-softmax tensor.
- ``top_candidates``: the ``width`` largest logits of each row (``torch.topk``'s values), for
  truncation. ``torch.topk`` on [512, 128k] bf16 spends ~550 us in radix-select passes; here one
  streaming pass takes the maximum of every 128 columns, the ``width``-th largest of those is a
  threshold that leaves at least ``width`` columns, only the blocks that reach it are read again
  to collect those columns, and ``torch.topk`` finishes on them. A row with more than
  ``CAPACITY`` such columns (a flat or masked row) is selected exactly by a per-row radix search
  instead. The block maxima also let ``race`` skip chunks without reading them.

A row is cut into splits of ``CHUNKS`` chunks of ``CHUNK`` columns, one program per (row, split),
so 512 rows of 128k columns keep every SM busy; each program writes one partial result per
split and a few torch ops on ``[rows, splits]`` finish the reduction. A chunk is one Philox
block of ``reference.keyed_exponential`` (4 words x ``PHILOX_GROUP`` calls), so the in-kernel
noise of column ``v`` is bit for bit the keyed noise kernel's.

The arithmetic matches the torch references in ``kernels/reference.py`` operation for operation
(IEEE divisions, libdevice ``exp`` on the GPU), so on the same inputs and noise keys the kernels
pick the same tokens as the references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pagecast.kernels.keyed_noise import philox4x32_10
from pagecast.kernels.reference import PHILOX_GROUP

# Columns per chunk: one Philox block (PHILOX_GROUP calls of four words each).
CHUNK = 4 * PHILOX_GROUP
# Chunks per program: 8 x 1024 columns, so a 128k row is 16 programs.
CHUNKS = 8


@triton.jit
def torch_exp(x, PRECISE: tl.constexpr):
    # libdevice's expf is the CUDA math library's (what torch.exp and torch's CUDA softmax run);
    # tl.exp is ex2.approx. The interpreter has no libdevice, and its tl.exp is NumPy's. Also the
    # MoE routing kernel's (kernels/moe_route_kernel.py).
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _noise(word):
    # Exactly kernels/keyed_noise.py's _store_exponential: u in (0, 1), exact in fp32.
    u = ((word >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08
    return -tl.log(u)


@triton.jit
def _race_slice(
    logits, cols, valid, word, temperature, cut_value, cut_token, tie_drop, ties_before, row_max, min_p,
    best_score, best_col, TIES: tl.constexpr, PRECISE: tl.constexpr,
):
    """One quarter of a chunk: update the running (best score, its column) and tie count."""
    x = tl.math.div_rn(logits, temperature)
    at = (x == cut_value) & valid
    keep = valid & ((x > cut_value) | (at & (cols >= cut_token)))
    if TIES:
        # Tokens tied at the cutoff are dropped lowest column first: the first tie_drop of them.
        index = ties_before + tl.cumsum(at.to(tl.int32), 0) - at.to(tl.int32)
        keep = keep & (~at | (index >= tie_drop))
        ties_before += tl.sum(at.to(tl.int32), 0)
    p = torch_exp(x - row_max, PRECISE)
    keep = keep & (p >= min_p)
    score = tl.where(keep, tl.math.div_rn(p, _noise(word)), -1.0)
    top = tl.max(score, 0)
    if top > best_score:  # strictly: on equal scores the lower column (seen first) stays
        best_score = top
        best_col = tl.min(tl.where(score == top, cols, 2147483647), 0)
    return best_score, best_col, ties_before


@triton.jit
def _chunk_logits(row_ptr, cols0, vocab, GROUP: tl.constexpr):
    """A chunk's four GROUP-column quarters of one row, in fp32 (-inf past the vocabulary)."""
    l0 = tl.load(row_ptr + cols0, mask=cols0 < vocab, other=float("-inf")).to(tl.float32)
    l1 = tl.load(row_ptr + cols0 + GROUP, mask=cols0 + GROUP < vocab, other=float("-inf")).to(tl.float32)
    l2 = tl.load(row_ptr + cols0 + 2 * GROUP, mask=cols0 + 2 * GROUP < vocab, other=float("-inf")).to(tl.float32)
    l3 = tl.load(row_ptr + cols0 + 3 * GROUP, mask=cols0 + 3 * GROUP < vocab, other=float("-inf")).to(tl.float32)
    return l0, l1, l2, l3


# Triton compiles a kernel once per specialisation of its arguments: integers by "equals 1" and
# "divisible by 16", pointers by 16-byte alignment. The integers here follow from the vocabulary
# (fixed by the artifact), but the per-row pointers are views whose alignment follows the batch
# (a column of a [rows, 2] tensor is aligned or not with the row count), and each program loads
# one scalar from them: they are not specialised on alignment, so that the variants a server can
# launch are the finite set enginebuild compiles (builder/tune.py, compile_sampler_kernels).
_PER_ROW_RACE = ["temperature_ptr", "cut_value_ptr", "cut_token_ptr", "tie_drop_ptr", "tie_prefix_ptr", "row_max_ptr",
                 "min_p_ptr", "keys_ptr", "offsets_ptr", "block_max_ptr", "score_ptr", "token_ptr"]  # fmt: skip


@triton.jit(do_not_specialize_on_alignment=_PER_ROW_RACE)
def _race_kernel(
    logits_ptr,  # logits: [rows, vocab] fp32 / fp16 / bf16, unit column stride
    temperature_ptr,  # [rows] fp32
    cut_value_ptr,  # [rows] fp32: the truncation cutoff in x = logits / temperature
    cut_token_ptr,  # [rows] int64: tokens at the cutoff value with a lower id are dropped
    tie_drop_ptr,  # [rows] int64: how many tokens at the cutoff value are dropped, lowest first
    tie_prefix_ptr,  # [rows, splits] int32: tokens at the cutoff value before each split (TIES)
    row_max_ptr,  # [rows] fp32: max of x
    min_p_ptr,  # [rows] fp32
    keys_ptr,  # [rows] int64: noise key
    offsets_ptr,  # [rows] int64 in [0, 2**32): noise offset
    block_max_ptr,  # [rows, num_blocks] fp32: max logit of each TOPK_BLOCK columns (BLOCK_MAX)
    score_ptr,  # out: [rows, splits] fp32, the best score of the split (-1: nothing kept)
    token_ptr,  # out: [rows, splits] int32, its column
    stride_row,
    vocab,
    splits,
    num_blocks,
    GROUP: tl.constexpr,
    CHUNKS: tl.constexpr,
    TIES: tl.constexpr,
    PRECISE: tl.constexpr,
    BLOCK_MAX: tl.constexpr,
    MAX_PER_CHUNK: tl.constexpr,  # block maxima per chunk
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    cut_value = tl.load(cut_value_ptr + row)
    cut_token = tl.load(cut_token_ptr + row).to(tl.int32)
    tie_drop = tl.load(tie_drop_ptr + row).to(tl.int32)
    row_max = tl.load(row_max_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    key = tl.load(keys_ptr + row)
    k0_start = (key & 0xFFFFFFFF).to(tl.uint32)
    k1_start = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    offset = tl.load(offsets_ptr + row).to(tl.uint32)
    ties_before = tl.zeros([], dtype=tl.int32)
    if TIES:
        ties_before += tl.load(tie_prefix_ptr + row * splits + split)
    j = tl.arange(0, GROUP)
    best_score = tl.full([], -2.0, tl.float32)
    best_col = tl.zeros([], dtype=tl.int32)
    row_ptr = logits_ptr + row * stride_row
    for c in range(CHUNKS):
        chunk = split * CHUNKS + c
        base = chunk * 4 * GROUP
        if BLOCK_MAX:
            # The chunk's largest logit from top_candidates' block maxima: a chunk that keeps
            # nothing is never read.
            blocks = chunk * MAX_PER_CHUNK + tl.arange(0, MAX_PER_CHUNK)
            chunk_max = tl.max(tl.load(block_max_ptr + row * num_blocks + blocks, mask=blocks < num_blocks,
                                       other=float("-inf")), 0)  # fmt: skip
        else:
            l0, l1, l2, l3 = _chunk_logits(row_ptr, base + j, vocab, GROUP)
            chunk_max = tl.max(tl.maximum(tl.maximum(l0, l1), tl.maximum(l2, l3)), 0)
        # x is monotone in the logit, so a chunk whose largest x is below the cutoff keeps
        # nothing and holds no tie: skip it (almost every chunk under top-k).
        if (tl.math.div_rn(chunk_max, temperature) >= cut_value) & (base < vocab):
            if BLOCK_MAX:
                l0, l1, l2, l3 = _chunk_logits(row_ptr, base + j, vocab, GROUP)
            cols0 = base + j
            cols1 = cols0 + GROUP
            cols2 = cols1 + GROUP
            cols3 = cols2 + GROUP
            # Philox4x32-10, counter (chunk * GROUP + j, offset, 0, 0): reference.keyed_exponential.
            c0, c1, c2, c3 = philox4x32_10(
                (chunk * GROUP + j).to(tl.uint32), tl.zeros([GROUP], dtype=tl.uint32) + offset, k0_start, k1_start,
                GROUP,
            )
            best_score, best_col, ties_before = _race_slice(
                l0, cols0, cols0 < vocab, c0, temperature, cut_value, cut_token, tie_drop, ties_before, row_max,
                min_p, best_score, best_col, TIES, PRECISE)
            best_score, best_col, ties_before = _race_slice(
                l1, cols1, cols1 < vocab, c1, temperature, cut_value, cut_token, tie_drop, ties_before, row_max,
                min_p, best_score, best_col, TIES, PRECISE)
            best_score, best_col, ties_before = _race_slice(
                l2, cols2, cols2 < vocab, c2, temperature, cut_value, cut_token, tie_drop, ties_before, row_max,
                min_p, best_score, best_col, TIES, PRECISE)
            best_score, best_col, ties_before = _race_slice(
                l3, cols3, cols3 < vocab, c3, temperature, cut_value, cut_token, tie_drop, ties_before, row_max,
                min_p, best_score, best_col, TIES, PRECISE)
    tl.store(score_ptr + row * splits + split, best_score)
    tl.store(token_ptr + row * splits + split, best_col)


@triton.jit(do_not_specialize_on_alignment=["temperature_ptr", "value_ptr", "wanted_ptr", "counts_ptr"])
def _count_ties_kernel(
    logits_ptr,  # logits: [rows, vocab], unit column stride
    temperature_ptr,  # [rows] fp32
    value_ptr,  # [rows] fp32: the value (of x = logits / temperature) to count
    wanted_ptr,  # [rows] bool: rows to count; the others get 0 without reading their row
    counts_ptr,  # out: [rows, splits] int32
    stride_row,
    vocab,
    splits,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    count = tl.zeros([], dtype=tl.int32)
    if tl.load(wanted_ptr + row) != 0:
        temperature = tl.load(temperature_ptr + row)
        value = tl.load(value_ptr + row)
        row_ptr = logits_ptr + row * stride_row
        for c in range(CHUNKS):
            cols = (split * CHUNKS + c) * BLOCK + tl.arange(0, BLOCK)
            valid = cols < vocab
            logits = tl.load(row_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32)
            if tl.math.div_rn(tl.max(logits, 0), temperature) >= value:
                x = tl.math.div_rn(logits, temperature)
                count += tl.sum(((x == value) & valid).to(tl.int32), 0)
    tl.store(counts_ptr + row * splits + split, count)


@triton.jit(do_not_specialize_on_alignment=["scored_ptr", "max_ptr", "sum_ptr", "greater_ptr"])
def _logprob_stats_kernel(
    logits_ptr,  # logits: [rows, vocab], unit column stride
    scored_ptr,  # [rows] fp32: the scored token's logit
    max_ptr,  # out: [rows, splits] fp32, max logit of the split
    sum_ptr,  # out: [rows, splits] fp32, sum of exp(logit - that max)
    greater_ptr,  # out: [rows, splits] int32, logits strictly greater than the scored one
    stride_row,
    vocab,
    splits,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    scored = tl.load(scored_ptr + row)
    row_ptr = logits_ptr + row * stride_row
    # Finite start: exp(-inf - (-inf)) would be nan; a split of -inf logits then sums to 0.
    m = tl.full([], -3.4028234663852886e38, tl.float32)
    total = tl.zeros([], dtype=tl.float32)
    greater = tl.zeros([], dtype=tl.int32)
    for c in range(CHUNKS):
        cols = (split * CHUNKS + c) * BLOCK + tl.arange(0, BLOCK)
        logits = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(logits, 0))
        total = total * tl.exp(m - new_m) + tl.sum(tl.exp(logits - new_m), 0)
        m = new_m
        greater += tl.sum((logits > scored).to(tl.int32), 0)
    tl.store(max_ptr + row * splits + split, m)
    tl.store(sum_ptr + row * splits + split, total)
    tl.store(greater_ptr + row * splits + split, greater)


def num_splits(vocab: int, chunks: int = CHUNKS) -> int:
    """Programs per row: the width of ``count_ties``'s result, which ``race`` takes back."""
    return max(1, triton.cdiv(triton.cdiv(vocab, CHUNK), chunks))


def _check_logits(logits: torch.Tensor, rows_like: dict[str, torch.Tensor]) -> torch.Tensor:
    """``logits`` with unit column stride (any row stride: a row slice of a wider tensor is
    read in place), after checking the per-row tensors' shapes."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab]; got shape {tuple(logits.shape)}")
    for name, t in rows_like.items():
        if t.shape != (logits.shape[0],):
            raise ValueError(f"{name} must be [rows] = [{logits.shape[0]}]; got {tuple(t.shape)}")
    if logits.stride(1) != 1:
        return logits.contiguous()
    # A row slice of the logits (prompt logprobs' chunks) starts 16-byte aligned or not with its
    # first row when a row's bytes are not a multiple of 16: copied to aligned memory then, so the
    # kernels see one alignment, the one enginebuild compiled (rare: vocabularies are multiples of 4).
    return logits if logits.data_ptr() % 16 == 0 else logits.clone()


def race(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    cut_value: torch.Tensor,
    cut_token: torch.Tensor,
    tie_drop: torch.Tensor,
    tie_counts: torch.Tensor | None,
    row_max: torch.Tensor,
    min_p: torch.Tensor,
    keys: torch.Tensor,
    offsets: torch.Tensor,
    chunks: int = CHUNKS,
    block_max: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sampled token of each row ([rows] int64): ``reference.race`` with the noise
    ``reference.keyed_exponential(keys, offsets, vocab)`` drawn in the kernel.

    ``block_max`` (``top_candidates``' maxima of every ``TOPK_BLOCK`` columns, fp32) lets the
    kernel skip chunks without reading them.

    ``tie_counts`` ([rows, num_splits(vocab, chunks)] int32, ``count_ties``'s result) is needed
    only when some row has ``tie_drop > 0``: it places each split within the row's tie group.
    Per-row tensors are fp32 except ``cut_token``, ``tie_drop``, ``keys`` and ``offsets``
    (int64)."""
    logits = _check_logits(logits, {"temperature": temperature, "cut_value": cut_value, "cut_token": cut_token,
                                    "tie_drop": tie_drop, "row_max": row_max, "min_p": min_p, "keys": keys,
                                    "offsets": offsets})  # fmt: skip
    rows, vocab = logits.shape
    splits = num_splits(vocab, chunks)
    if tie_counts is not None and tie_counts.shape != (rows, splits):
        raise ValueError(f"tie_counts must be [rows, splits] = [{rows}, {splits}]; got {tuple(tie_counts.shape)}")
    scores = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    tokens = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    prefix = tokens  # an int32 placeholder when there is no tie group to place (TIES off)
    if tie_counts is not None:
        counts = tie_counts.to(torch.int32)
        prefix = (counts.cumsum(1, dtype=torch.int32) - counts).contiguous()
    if block_max is not None and block_max.shape != (rows, triton.cdiv(vocab, TOPK_BLOCK)):
        raise ValueError(f"block_max must be [rows, cdiv(vocab, {TOPK_BLOCK})]; got {tuple(block_max.shape)}")
    _race_kernel[(rows, splits)](
        logits, temperature.float().contiguous(), cut_value.float().contiguous(), cut_token.long().contiguous(),
        tie_drop.long().contiguous(), prefix, row_max.float().contiguous(), min_p.float().contiguous(),
        keys.long().contiguous(), offsets.long().contiguous(), scores if block_max is None else block_max, scores,
        tokens, logits.stride(0), vocab, splits, triton.cdiv(vocab, TOPK_BLOCK), GROUP=PHILOX_GROUP, CHUNKS=chunks,
        TIES=tie_counts is not None, PRECISE=logits.is_cuda, BLOCK_MAX=block_max is not None,
        MAX_PER_CHUNK=CHUNK // TOPK_BLOCK,
    )  # fmt: skip
    # The first split holding the best score: torch's argmax keeps the first maximum, as the
    # kernel does within a split, so ties go to the lowest column as in reference.race.
    best = scores.argmax(dim=1, keepdim=True)
    return tokens.gather(1, best).squeeze(1).long()


def count_ties(
    logits: torch.Tensor, temperature: torch.Tensor, value: torch.Tensor, wanted: torch.Tensor, chunks: int = CHUNKS
) -> torch.Tensor:
    """Per row and split, how many columns have ``logits / temperature == value`` (``[rows,
    num_splits(vocab, chunks)]`` int32; rows not ``wanted`` give 0 without being read)."""
    logits = _check_logits(logits, {"temperature": temperature, "value": value, "wanted": wanted})
    rows, vocab = logits.shape
    splits = num_splits(vocab, chunks)
    counts = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    if rows:
        _count_ties_kernel[(rows, splits)](
            logits, temperature.float().contiguous(), value.float().contiguous(), wanted.bool().contiguous(), counts,
            logits.stride(0), vocab, splits, BLOCK=CHUNK, CHUNKS=chunks,
        )  # fmt: skip
    return counts


def logprob_stats(
    logits: torch.Tensor, scored: torch.Tensor, chunks: int = CHUNKS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row and split ``[rows, splits]``: the max logit, ``sum(exp(logit - max))`` and the
    number of logits strictly greater than ``scored`` ([rows] fp32); see
    ``reference.logprob_stats``, which gives the same with one split."""
    logits = _check_logits(logits, {"scored": scored})
    rows, vocab = logits.shape
    splits = num_splits(vocab, chunks)
    maxes = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    sums = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    greater = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    if rows:
        _logprob_stats_kernel[(rows, splits)](
            logits, scored.float().contiguous(), maxes, sums, greater, logits.stride(0), vocab, splits,
            BLOCK=CHUNK, CHUNKS=chunks,
        )  # fmt: skip
    return maxes, sums, greater


# --- top_candidates ---------------------------------------------------------------------------

# Columns per block whose maxima give each row's threshold (a divisor of CHUNK: the race reads
# them too), and block maxima per program.
TOPK_BLOCK = 128
TOPK_BLOCKS = 64
# Blocks per program of the collecting pass.
COLLECT_BLOCKS = 8
# Columns at or above the threshold kept per row; a row with more goes to the exact search.
CAPACITY = 1024


@triton.jit
def _block_max_kernel(
    logits_ptr,  # [rows, vocab], unit column stride
    out_ptr,  # out: [rows, num_blocks] fp32, the max of each BLOCK columns
    stride_row,
    vocab,
    num_blocks,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    cols = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    tl.store(out_ptr + row * num_blocks + blocks, tl.max(x, 1), mask=blocks < num_blocks)


@triton.jit
def _order_key(x, LOW_BIT: tl.constexpr):
    """An fp32's bits as an int64 in [0, 2**(32 - LOW_BIT)) that orders as the floats do (-0.0
    as +0.0), without the LOW_BIT low bits, which the logits' own dtype leaves 0 (negative
    values' keys are their bits inverted, so the dropped bits are not 0 there)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, (~bits).to(tl.int64), bits.to(tl.int64) + 2147483648) >> LOW_BIT


@triton.jit
def _kth_key(keys, valid, width, LOW_BIT: tl.constexpr):
    """The width-th largest of ``keys`` (where ``valid``): the largest key with at least
    ``width`` keys at or above it, found one bit at a time from the top."""
    kth = tl.zeros([], dtype=tl.int64)
    for i in range(32 - LOW_BIT):
        candidate = kth | (tl.full([], 1, tl.int64) << (31 - LOW_BIT - i))
        if tl.sum(((keys >= candidate) & valid).to(tl.int32), 0) >= width:
            kth = candidate
    return kth


@triton.jit(do_not_specialize=["width"])
def _threshold_kernel(
    block_max_ptr,  # [rows, num_blocks] fp32
    threshold_ptr,  # out: [rows] fp32, the width-th largest block maximum
    num_blocks,
    width,
    NUM_BLOCKS_PAD: tl.constexpr,
    LOW_BIT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.arange(0, NUM_BLOCKS_PAD)
    valid = blocks < num_blocks
    maxima = tl.load(block_max_ptr + row * num_blocks + blocks, mask=valid, other=float("-inf"))
    keys = _order_key(maxima, LOW_BIT)
    kth = _kth_key(keys, valid, width, LOW_BIT)
    # The maximum with that key (any of them: equal keys are equal values).
    hit = (keys == kth) & valid
    tl.store(threshold_ptr + row, tl.max(tl.where(hit, maxima, float("-inf")), 0))


@triton.jit
def _collect_kernel(
    logits_ptr,  # [rows, vocab], unit column stride
    block_max_ptr,  # [rows, num_blocks] fp32
    threshold_ptr,  # [rows] fp32
    count_ptr,  # [rows] int32, zeroed: columns at or above the threshold (all of them, kept or not)
    values_ptr,  # out: [rows, capacity] fp32, the first ``capacity`` such columns' logits
    ids_ptr,  # out: [rows, capacity] int32, and their columns
    stride_row,
    vocab,
    num_blocks,
    capacity,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    threshold = tl.load(threshold_ptr + row)
    # Only blocks whose maximum reaches the threshold are read (about width of a row's blocks).
    wanted = tl.load(block_max_ptr + row * num_blocks + blocks, mask=blocks < num_blocks, other=float("-inf")) >= threshold
    if tl.max(wanted.to(tl.int32), 0) > 0:
        cols = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        read = wanted[:, None] & (cols < vocab)
        x = tl.load(logits_ptr + row * stride_row + cols, mask=read, other=float("-inf")).to(tl.float32)
        hit = read & (x >= threshold)
        # A slot per column (a few dozen per row): the columns land in no particular order.
        slot = tl.atomic_add(count_ptr + row + tl.zeros_like(cols), 1, mask=hit)
        keep = hit & (slot < capacity)
        tl.store(values_ptr + row * capacity + slot, x, mask=keep)
        tl.store(ids_ptr + row * capacity + slot, cols, mask=keep)


@triton.jit
def _write_keyed(row_ptr, vocab, kth, filled, values_ptr, ids_ptr, width, ABOVE: tl.constexpr,
                 LOW_BIT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Append the row's columns whose key is above ``kth`` (ABOVE) or equal to it, in column
    order, after the ``filled`` already written, up to ``width`` in all; returns how many
    there were with ``filled`` (written or not)."""
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < vocab
        x = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        key = _order_key(x, LOW_BIT)
        if ABOVE:
            hit = (key > kth) & valid
        else:
            hit = (key == kth) & valid
        slot = filled + tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(values_ptr + slot, x, mask=hit & (slot < width))
        tl.store(ids_ptr + slot, cols, mask=hit & (slot < width))
        filled += tl.sum(hit.to(tl.int32), 0)
    return filled


@triton.jit(do_not_specialize=["width"])  # one compiled kernel for every top_k
def _select_kernel(
    logits_ptr,  # [rows, vocab], unit column stride
    count_ptr,  # [rows] int32: _collect_kernel's counts; rows within capacity are skipped
    values_ptr,  # out: [rows, width] fp32, the row's width largest logits, in no order
    ids_ptr,  # out: [rows, width] int32, their columns (among equal values, the lowest)
    stride_row,
    vocab,
    capacity,
    width,
    LOW_BIT: tl.constexpr,  # the key bits below this are 0 for the logits' dtype
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if tl.load(count_ptr + row) > capacity:
        row_ptr = logits_ptr + row * stride_row
        # The width-th largest key, one bit at a time from the top, as _kth_key does, with the
        # row streamed once per bit.
        kth = tl.zeros([], dtype=tl.int64)
        for i in range(32 - LOW_BIT):
            candidate = kth | (tl.full([], 1, tl.int64) << (31 - LOW_BIT - i))
            n = tl.zeros([], dtype=tl.int32)
            for start in range(0, vocab, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                valid = cols < vocab
                key = _order_key(tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32), LOW_BIT)
                n += tl.sum(((key >= candidate) & valid).to(tl.int32), 0)
            if n >= width:
                kth = candidate
        # Every column above it (fewer than width), then the lowest columns equal to it.
        out_values, out_ids = values_ptr + row * width, ids_ptr + row * width
        above = _write_keyed(row_ptr, vocab, kth, tl.zeros([], dtype=tl.int32), out_values, out_ids, width, True,
                             LOW_BIT, BLOCK)  # fmt: skip
        _write_keyed(row_ptr, vocab, kth, above, out_values, out_ids, width, False, LOW_BIT, BLOCK)


def top_candidates_apply(vocab: int, width: int, capacity: int) -> bool:
    """Whether ``top_candidates`` takes its threshold path for this shape (otherwise it is
    ``torch.topk``): a row wider than the capacity, with enough blocks for a threshold."""
    return vocab > capacity and triton.cdiv(vocab, TOPK_BLOCK) >= width and width <= capacity // 4


def top_candidates(
    logits: torch.Tensor, width: int, capacity: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The ``width`` largest logits of each row, descending (fp32), and their columns (int64):
    ``torch.topk(logits, width)``'s values, and columns holding them (which of several equal
    values at the last place are chosen is not specified, as for ``torch.topk``). Third: the
    maxima of every ``TOPK_BLOCK`` columns ([rows, blocks] fp32, for ``race``), or None where
    this is ``torch.topk``. ``capacity`` (default ``CAPACITY``) is how many columns per row the
    threshold may leave before the row is searched exactly instead."""
    logits = _check_logits(logits, {})
    rows, vocab = logits.shape
    capacity = CAPACITY if capacity is None else capacity
    if not top_candidates_apply(vocab, width, capacity) or rows == 0:
        values, ids = logits.topk(width, dim=1)
        return values.float(), ids, None
    device = logits.device
    num_blocks = triton.cdiv(vocab, TOPK_BLOCK)
    low_bit = {torch.bfloat16: 16, torch.float16: 13}.get(logits.dtype, 0)
    block_max = torch.empty(rows, num_blocks, dtype=torch.float32, device=device)
    _block_max_kernel[(rows, triton.cdiv(num_blocks, TOPK_BLOCKS))](
        logits, block_max, logits.stride(0), vocab, num_blocks, BLOCK=TOPK_BLOCK, BLOCKS=TOPK_BLOCKS,
    )  # fmt: skip
    # Block maxima are distinct columns, so at least width columns are at or above the
    # width-th largest of them.
    threshold = torch.empty(rows, dtype=torch.float32, device=device)
    _threshold_kernel[(rows,)](
        block_max, threshold, num_blocks, width, NUM_BLOCKS_PAD=triton.next_power_of_2(num_blocks), LOW_BIT=low_bit,
        num_warps=8,
    )  # fmt: skip
    counts = torch.zeros(rows, dtype=torch.int32, device=device)
    values = torch.full((rows, capacity), float("-inf"), dtype=torch.float32, device=device)
    ids = torch.zeros(rows, capacity, dtype=torch.int32, device=device)
    _collect_kernel[(rows, triton.cdiv(num_blocks, COLLECT_BLOCKS))](
        logits, block_max, threshold, counts, values, ids, logits.stride(0), vocab, num_blocks, capacity,
        BLOCK=TOPK_BLOCK, BLOCKS=COLLECT_BLOCKS,
    )  # fmt: skip
    top, where = values.topk(width, dim=1)
    top_ids = ids.gather(1, where)
    # Rows past the capacity: the exact search (every other row returns at once, leaving its
    # row of these unwritten: torch.where below takes the threshold's result there).
    exact_values = torch.empty(rows, width, dtype=torch.float32, device=device)
    exact_ids = torch.empty(rows, width, dtype=torch.int32, device=device)
    _select_kernel[(rows,)](
        logits, counts, exact_values, exact_ids, logits.stride(0), vocab, capacity, width, LOW_BIT=low_bit,
        BLOCK=1024, num_warps=8,
    )  # fmt: skip
    exact_values, order = exact_values.sort(dim=1, descending=True)
    exact_ids = exact_ids.gather(1, order)
    overflow = (counts > capacity).unsqueeze(1)
    values = torch.where(overflow, exact_values, top)
    return values, torch.where(overflow, exact_ids, top_ids).long(), block_max
