"""BlockPool: exact block ids for allocation, sharing, prefix hits and LRU eviction (tiny pools, CPU)."""

from __future__ import annotations

import pytest

from pagecast.runtime.block_pool import BlockPool
from pagecast.runtime.request import Request
from pagecast.runtime.sampling_params import SamplingParams


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=8))


def compute_all(pool: BlockPool, request: Request, computed_blocks: list[int] | None = None) -> None:
    """Allocate for every uncomputed token, mark them computed and cache the full blocks: one
    whole prefill, as the scheduler and runner would do it."""
    num_cached = len(computed_blocks or []) * pool.block_size
    assert pool.allocate_slots(request, request.num_tokens - num_cached, computed_blocks)
    request.num_computed_tokens = request.num_tokens
    pool.cache_full_blocks(request)


def test_allocate_and_free_exact_block_ids() -> None:
    pool = BlockPool(num_blocks=10, block_size=4)
    a = make_request("a", list(range(10)))
    b = make_request("b", list(range(100, 105)))
    assert pool.allocate_slots(a, 10)
    assert a.block_ids == [0, 1, 2]
    assert pool.allocate_slots(b, 5)
    assert b.block_ids == [3, 4]
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.usage) == (5, 5, 0.5)
    pool.free(a)
    assert a.block_ids == []
    assert pool.num_free_blocks == 8
    # Uncached freed blocks are reused first, in their table order.
    c = make_request("c", list(range(200, 216)))
    assert pool.allocate_slots(c, 16)
    assert c.block_ids == [0, 1, 2, 5]


def test_decode_grows_the_table_only_at_block_boundaries() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    r = make_request("r", [1, 2, 3, 4])
    assert pool.allocate_slots(r, 4)
    assert r.block_ids == [0]
    r.num_computed_tokens = 4
    assert pool.allocate_slots(r, 1)
    assert r.block_ids == [0, 1]
    r.num_computed_tokens = 5
    assert pool.allocate_slots(r, 1)
    assert r.block_ids == [0, 1]
    assert pool.num_free_blocks == 2


def test_allocation_is_all_or_nothing() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    a = make_request("a", list(range(12)))
    assert pool.allocate_slots(a, 12)
    b = make_request("b", list(range(50, 58)))
    assert not pool.allocate_slots(b, 8)
    assert b.block_ids == []
    assert pool.num_free_blocks == 1
    # Growing a request that holds blocks fails the same way, leaving its table as it was.
    a.num_computed_tokens = 12
    assert not pool.allocate_slots(a, 5)
    assert a.block_ids == [0, 1, 2]
    assert pool.num_free_blocks == 1


def test_allocation_counts_free_cached_blocks_it_reuses() -> None:
    # A prefix hit on free cached blocks removes them from the free list, so they cannot also be
    # handed out as new blocks: the check must not count them twice.
    pool = BlockPool(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    compute_all(pool, a)  # blocks 0, 1 cached; 2 holds the partial block
    pool.free(a)
    b = make_request("b", [1, 2, 3, 4, 9, 9, 9, 9, 9])
    blocks, num_cached = pool.get_computed_blocks(b)
    assert (blocks, num_cached) == ([0, 1], 4)
    # 9 tokens need 5 blocks: 2 reused + 3 new, but only 2 blocks are free besides the hits.
    assert not pool.allocate_slots(b, 5, blocks)
    assert b.block_ids == []
    assert pool.num_free_blocks == 4
    assert [pool.ref_count(i) for i in range(4)] == [0, 0, 0, 0]


def test_shared_prefix_shares_physical_blocks_with_ref_counts() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    a = make_request("a", list(range(10)))
    compute_all(pool, a)
    assert a.block_ids == [0, 1, 2]
    assert len(a.block_hashes) == 2 and pool.num_cached_blocks == 2
    b = make_request("b", list(range(8)) + [77, 78, 79])
    blocks, num_cached = pool.get_computed_blocks(b)
    assert (blocks, num_cached) == ([0, 1], 8)
    assert pool.ref_count(0) == 1  # the lookup takes no reference
    assert pool.allocate_slots(b, 3, blocks)
    assert b.block_ids == [0, 1, 3]
    assert [pool.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert pool.num_used_blocks == 4
    pool.free(a)
    assert a.block_ids == [] and a.block_hashes == []  # a resumption starts a new chain
    assert [pool.ref_count(i) for i in range(4)] == [1, 1, 0, 1]
    assert pool.num_used_blocks == 3
    pool.free(b)
    assert pool.num_free_blocks == 8


def test_lookup_never_covers_the_whole_sequence() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    compute_all(pool, make_request("a", list(range(12))))
    # All 8 tokens are cached, but the last one must be computed for its logits.
    assert pool.get_computed_blocks(make_request("b", list(range(8)))) == ([0], 4)
    assert pool.get_computed_blocks(make_request("c", list(range(9)))) == ([0, 1], 8)
    assert pool.get_computed_blocks(make_request("d", list(range(13)))) == ([0, 1, 2], 12)


def test_prefix_hit_counters() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    compute_all(pool, make_request("a", list(range(10))))
    b = make_request("b", list(range(8)) + [50, 51])
    pool.get_computed_blocks(b)
    assert (pool.num_prefix_queries, pool.num_prefix_hits) == (10, 8)
    c = make_request("c", [9, 9, 9, 9, 9])
    pool.get_computed_blocks(c)
    assert (pool.num_prefix_queries, pool.num_prefix_hits) == (15, 8)


def test_head_of_line_retries_are_counted_once() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    big = make_request("big", list(range(20)))
    for _ in range(3):  # the scheduler retries the head of the queue every step
        blocks, _ = pool.get_computed_blocks(big)
        assert not pool.allocate_slots(big, 20, blocks)
    assert pool.num_prefix_queries == 20
    small = make_request("small", [1, 2, 3])
    pool.get_computed_blocks(small)
    assert pool.allocate_slots(small, 3)
    pool.get_computed_blocks(small)  # looked up again after an allocation (a resumption): counts
    assert pool.num_prefix_queries == 26


def test_lru_evicts_least_recently_freed_cached_block_first() -> None:
    pool = BlockPool(num_blocks=6, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    compute_all(pool, a)
    assert a.block_ids == [0, 1, 2]
    pool.free(a)  # free list: 2 (uncached, head), 3, 4, 5, then a's tail block 1, then 0
    b = make_request("b", [7, 8, 9, 10, 11])
    compute_all(pool, b)
    assert b.block_ids == [2, 3, 4]
    pool.free(b)  # free list: 4, 5, 1, 0, 3, 2
    assert pool.num_cached_blocks == 4
    c = make_request("c", [20, 21, 22, 23, 24, 25])
    assert pool.allocate_slots(c, 6)
    # The uncached blocks go first, then a's last block (the least recently freed cached one).
    assert c.block_ids == [4, 5, 1]
    assert pool.num_cached_blocks == 3
    # a's second block no longer hits; its first still does. b is untouched.
    assert pool.get_computed_blocks(make_request("a2", [1, 2, 3, 4, 5])) == ([0], 2)
    assert pool.get_computed_blocks(make_request("b2", [7, 8, 9, 10, 11])) == ([2, 3], 4)
    d = make_request("d", [30, 31])
    assert pool.allocate_slots(d, 2)
    assert d.block_ids == [0]
    assert pool.get_computed_blocks(make_request("a3", [1, 2, 3, 4, 5])) == ([], 0)


def test_a_prefix_hit_makes_blocks_most_recently_used() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    compute_all(pool, a)
    pool.free(a)  # free: 1 (uncached), 2, 3, 0
    b = make_request("b", [5, 6, 7])
    compute_all(pool, b)
    assert b.block_ids == [1, 2]
    pool.free(b)  # free: 2, 3, 0, 1
    a_again = make_request("a_again", [1, 2, 3])
    compute_all(pool, a_again, pool.get_computed_blocks(a_again)[0])
    assert a_again.block_ids == [0, 2]
    pool.free(a_again)  # free: 2, 3, 1, 0 -- a's block 0 is now newer than b's block 1
    c = make_request("c", [9, 9, 9, 9, 9, 9])
    assert pool.allocate_slots(c, 6)
    assert c.block_ids == [2, 3, 1]
    assert pool.get_computed_blocks(make_request("a3", [1, 2, 3])) == ([0], 2)
    assert pool.get_computed_blocks(make_request("b3", [5, 6, 7])) == ([], 0)


def test_blocks_with_equal_tokens_but_different_prefixes_never_match() -> None:
    pool = BlockPool(num_blocks=8, block_size=2)
    compute_all(pool, make_request("a", [1, 2, 5, 6, 0]))
    # Same second block, different first block: nothing matches.
    assert pool.get_computed_blocks(make_request("b", [3, 4, 5, 6, 0])) == ([], 0)
    # CPython hashes -1 and -2 alike, so these keys collide in the dict; the index still
    # compares the tokens and must not confuse them.
    assert hash((-1, 5)) == hash((-2, 5))
    compute_all(pool, make_request("c", [-1, 5, 0]))
    assert pool.get_computed_blocks(make_request("d", [-2, 5, 0])) == ([], 0)
    assert pool.get_computed_blocks(make_request("e", [-1, 5, 0])) == ([3], 2)


def test_duplicate_content_is_registered_once_and_the_chain_continues() -> None:
    pool = BlockPool(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3])
    b = make_request("b", [1, 2, 3])
    compute_all(pool, a)
    compute_all(pool, b)  # computed side by side, before either was cached
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    assert pool.num_cached_blocks == 1
    assert b.block_hashes == a.block_hashes
    # b decodes one more token, filling its second block: it chains onto a's first block.
    b.append_output_token(4)
    b.num_computed_tokens = 4
    pool.cache_full_blocks(b)
    assert pool.num_cached_blocks == 2
    assert pool.get_computed_blocks(make_request("c", [1, 2, 3, 4, 5])) == ([0, 3], 4)


def test_prefix_caching_disabled() -> None:
    pool = BlockPool(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5])
    compute_all(pool, a)
    assert a.block_hashes == [] and pool.num_cached_blocks == 0
    assert pool.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == ([], 0)
    assert pool.num_prefix_queries == 0


def test_reset_prefix_cache_only_when_no_block_is_held() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    compute_all(pool, a)
    assert not pool.reset_prefix_cache()
    assert pool.get_computed_blocks(make_request("b", [1, 2, 3])) == ([0], 2)
    pool.free(a)
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert pool.get_computed_blocks(make_request("c", [1, 2, 3])) == ([], 0)


def test_computed_blocks_only_on_first_allocation() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    compute_all(pool, make_request("a", [1, 2, 3]))
    b = make_request("b", [5, 6, 7])
    assert pool.allocate_slots(b, 3)
    with pytest.raises(ValueError, match="first allocation"):
        pool.allocate_slots(b, 1, [0])


def test_full_cycle_leaves_every_block_free() -> None:
    pool = BlockPool(num_blocks=16, block_size=4)
    prompts = [list(range(n)) + [n] * (i + 1) for i, n in enumerate((5, 9, 9, 13, 3, 9))]
    live: list[Request] = []
    for i, prompt in enumerate(prompts):
        r = make_request(str(i), prompt)
        blocks, num_cached = pool.get_computed_blocks(r)
        assert pool.allocate_slots(r, r.num_tokens - num_cached, blocks)
        r.num_computed_tokens = r.num_tokens
        pool.cache_full_blocks(r)
        for token in (1, 2, 3):  # a few decode steps
            r.append_output_token(token)
            assert pool.allocate_slots(r, 1)
            r.num_computed_tokens += 1
            pool.cache_full_blocks(r)
        live.append(r)
        if i % 2:
            pool.free(live.pop(0))
    assert pool.num_prefix_hits > 0
    for r in live:
        pool.free(r)
    assert pool.num_free_blocks == pool.num_blocks
    assert pool.usage == 0.0
    assert all(pool.ref_count(i) == 0 for i in range(pool.num_blocks))


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 16), (4, 0), (4, 1.5)])
def test_rejects_bad_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="must be a positive integer"):
        BlockPool(num_blocks, block_size)
