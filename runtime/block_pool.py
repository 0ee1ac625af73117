"""The KV block pool: physical blocks, their reference counts, the free list and the prefix cache.

The pool owns blocks; a request owns its block table (``request.block_ids``). The scheduler asks
the pool for blocks through ``get_computed_blocks`` / ``allocate_slots`` / ``cache_full_blocks`` /
``free``. Everything here runs once per request per engine step, on the hot path of a GPU engine
at batch 256, so each operation costs O(1) per block touched and allocates little.

Prefix caching. A block becomes cacheable once it is full of computed tokens. Its identity is its
whole prefix: the index is keyed by ``(parent prefix id, tuple of the block's token ids)`` and maps
to the block holding that content; the block then gets a fresh *prefix id* (a counter, never
reused) that its children use as their parent. Because keys hold the real tokens and prefix ids
are unique, two different prefixes can never share a key: no hash collision can make a request
read another prompt's K/V. ``request.block_hashes`` holds these prefix ids (the chained hashes
of the request's full blocks, as far as they are known: matched or cached).

Eviction. Blocks whose reference count drops to 0 stay in the index until their block is reused.
The free list is ordered for reuse: blocks with no cached content at the head (they are worth
nothing), cached blocks at the tail in the order they were freed, so the least recently used
cached content is evicted first and only when no worthless block is left.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagecast.runtime.request import Request

# Key of a cached block in the prefix index: (parent prefix id, the block's token ids).
BlockKey = tuple[int, tuple[int, ...]]

# The parent prefix id of a sequence's first block.
_ROOT_PREFIX_ID = 0


class BlockPool:
    """Fixed-size KV blocks shared by all requests, with reference counts and a prefix cache.

    State changes only through the methods below. ``num_free_blocks`` counts blocks no request
    references, including cached blocks that may still be reused by a prefix hit; it is the number
    of blocks ``allocate_slots`` can hand out.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Parallel per-block lists instead of block objects: cheaper to index on the hot path.
        self._ref_counts = [0] * num_blocks
        self._block_keys: list[BlockKey | None] = [None] * num_blocks
        self._block_prefix_ids = [_ROOT_PREFIX_ID] * num_blocks
        # Free blocks in reuse order (head first). An OrderedDict is a doubly-linked list with
        # O(1) removal of any block, which a prefix hit on a free cached block needs.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._index: dict[BlockKey, int] = {}
        self._next_prefix_id = _ROOT_PREFIX_ID + 1
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        # The request looked up last and not allocated since: a head-of-line request retried
        # every step must not inflate the hit-rate counters.
        self._last_queried: Request | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return (self.num_blocks - len(self._free)) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix index, used or free."""
        return len(self._index)

    def ref_count(self, block_id: int) -> int:
        """How many requests hold ``block_id`` (for metrics and tests)."""
        return self._ref_counts[block_id]

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The cached blocks covering the longest prefix of ``request.all_token_ids``.

        Returns (block ids, number of tokens they hold). Only full blocks count, and never the
        whole sequence: the last token must be computed for its logits. Takes no references, so
        the result is only valid until the pool next hands out blocks; pass it straight to
        ``allocate_slots``. Sets ``request.block_hashes`` to the matched prefix ids.
        """
        if not self.enable_prefix_caching:
            return [], 0
        block_size = self.block_size
        tokens = request.all_token_ids
        index = self._index
        prefix_ids = self._block_prefix_ids
        blocks: list[int] = []
        hashes: list[int] = []
        parent = _ROOT_PREFIX_ID
        start = 0
        for _ in range((len(tokens) - 1) // block_size):
            end = start + block_size
            block_id = index.get((parent, tuple(tokens[start:end])))
            if block_id is None:
                break
            blocks.append(block_id)
            parent = prefix_ids[block_id]
            hashes.append(parent)
            start = end
        request.block_hashes = hashes
        if request is not self._last_queried:
            self._last_queried = request
            self.num_prefix_queries += len(tokens)
            self.num_prefix_hits += start
        return blocks, start

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Grow ``request.block_ids`` to hold its computed tokens plus ``num_new_tokens``.

        ``computed_blocks`` (from ``get_computed_blocks``, first allocation only) are appended
        first, with a reference taken. All-or-nothing: returns False and changes nothing when the
        free list is too short.
        """
        block_ids = request.block_ids
        block_size = self.block_size
        num_computed_blocks = len(computed_blocks) if computed_blocks else 0
        num_tokens = request.num_computed_tokens + num_computed_blocks * block_size + num_new_tokens
        num_new_blocks = -(-num_tokens // block_size) - len(block_ids) - num_computed_blocks
        if num_new_blocks <= 0 and not num_computed_blocks:
            return True  # the decode fast path: the last block still has room
        ref_counts = self._ref_counts
        free = self._free
        if computed_blocks:
            if block_ids:
                raise ValueError(
                    f"computed_blocks may only be passed on a request's first allocation; "
                    f"request {request.request_id!r} already holds {len(block_ids)} blocks"
                )
            # Free cached blocks we are about to reuse cannot also be handed out as new ones.
            num_reused_free = sum(1 for b in computed_blocks if ref_counts[b] == 0)
            if num_new_blocks > len(free) - num_reused_free:
                return False
            for block_id in computed_blocks:
                if ref_counts[block_id] == 0:
                    del free[block_id]
                ref_counts[block_id] += 1
            block_ids.extend(computed_blocks)
        elif num_new_blocks > len(free):
            return False
        if request is self._last_queried:
            self._last_queried = None
        block_keys = self._block_keys
        index = self._index
        for _ in range(num_new_blocks):
            block_id, _ = free.popitem(last=False)
            key = block_keys[block_id]
            if key is not None:  # evict: the least recently used cached content goes first
                del index[key]
                block_keys[block_id] = None
            ref_counts[block_id] = 1
            block_ids.append(block_id)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens in the prefix index.

        Call after each step that advanced ``request.num_computed_tokens``. A block whose content
        is already cached in another block is not registered twice; the request continues the
        chain from the existing one.
        """
        if not self.enable_prefix_caching:
            return
        hashes = request.block_hashes
        # Only tokens whose ids are known: a pending token (asynchronous scheduling) may already
        # count as computed.
        num_full = min(request.num_computed_tokens, len(request.all_token_ids)) // self.block_size
        first = len(hashes)
        if first >= num_full:
            return
        block_size = self.block_size
        tokens = request.all_token_ids
        block_ids = request.block_ids
        index = self._index
        block_keys = self._block_keys
        prefix_ids = self._block_prefix_ids
        parent = hashes[-1] if hashes else _ROOT_PREFIX_ID
        for i in range(first, num_full):
            key = (parent, tuple(tokens[i * block_size : (i + 1) * block_size]))
            existing = index.get(key)
            if existing is not None:
                parent = prefix_ids[existing]
            else:
                block_id = block_ids[i]
                parent = self._next_prefix_id
                self._next_prefix_id += 1
                index[key] = block_id
                block_keys[block_id] = key
                prefix_ids[block_id] = parent
            hashes.append(parent)

    def free(self, request: Request) -> None:
        """Drop the request's references; ``request.block_ids`` and ``block_hashes`` become empty.

        Blocks nobody holds any more become free. Uncached ones go to the head of the free list
        (reused first); cached ones to the tail, tail blocks of the sequence first, so a
        sequence's last blocks are evicted before the prefix other requests are likelier to share.
        """
        ref_counts = self._ref_counts
        block_keys = self._block_keys
        free = self._free
        for block_id in reversed(request.block_ids):
            count = ref_counts[block_id] - 1
            ref_counts[block_id] = count
            if count == 0:
                free[block_id] = None
                if block_keys[block_id] is None:
                    free.move_to_end(block_id, last=False)
        request.block_ids = []
        # The hash chain describes blocks it no longer holds; a resumption starts a new one.
        request.block_hashes = []
        if request is self._last_queried:
            self._last_queried = None

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content (e.g. after a weight update). Only possible when no request
        holds a block, since running requests continue their hash chains; returns False then."""
        if len(self._free) != self.num_blocks:
            return False
        self._index.clear()
        self._block_keys = [None] * self.num_blocks
        self._block_prefix_ids = [_ROOT_PREFIX_ID] * self.num_blocks
        self._last_queried = None
        return True
