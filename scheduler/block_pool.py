"""KV block accounting and the prefix cache. Pure Python.

Invariants:
* every block id in ``range(num_blocks)`` is either free (ref count 0, in one of the three free
  sets below) or held;
* a request's block table owns one reference per block; blocks shared through the prefix cache
  have one reference per request holding them;
* a full block whose KV has been computed may be cached: ``_by_link`` finds it and its key — held
  or free — by its link (its parent's key and its tokens, see ``scheduler.request``) until it is
  reused for other tokens; ``_cached`` has its link. (A link is 32 + 8 x block size bytes:
  160 at block size 16, kept for cached blocks only. Keying the lookup by the sha256 key instead
  would need every prompt block hashed to find a hit.)

Free blocks are kept in three sets, and allocation takes from them in this order:
1. blocks used before that hold no cached prefix (most recently freed first);
2. blocks never used yet, in id order;
3. blocks that hold a cached prefix, the one freed longest ago first (an ``OrderedDict`` as an O(1)
   LRU list), evicting its hash.
So a prefix is evicted only when no other block is free, and a block the server has never
written is taken only when no written one is free without a cached prefix: on a CPU, where the
cache's pages are committed as they are first written, the server holds the memory its streams
(and the prefixes worth keeping) use, not the whole cache after a long run. A cached free block
counts as free: taking it back for a prefix hit costs nothing; allocating it evicts its hash.
"""

from __future__ import annotations

from collections import OrderedDict


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    __slots__ = ("_by_link", "_cached", "_free_cached", "_free_plain", "_refs", "_untouched", "enable_caching",
                 "evictions", "hits", "last_walk", "num_blocks", "queries")

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._free_plain: dict[int, None] = {}  # used before, no cached prefix (insertion order: freed order)
        self._untouched = list(range(num_blocks - 1, -1, -1))  # never used: popped from the end, lowest id first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # holding a cached prefix, LRU first
        self._refs = [0] * num_blocks
        self._by_link: dict[bytes, tuple[int, bytes]] = {}  # link -> (block, key)
        self._cached: dict[int, bytes] = {}  # block -> link
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of which found
        # Cached blocks are found by their link until evicted, and only then: while ``evictions``
        # stands still, a walk's hits stay valid. ``Request.cached_prefix`` keeps its last walk
        # here (evictions then, the tokens of the blocks found, those blocks and their keys): the
        # next prompt sharing its start takes those hits with one comparison of token lists.
        self.evictions = 0
        self.last_walk: tuple[int, list[int], list[int], list[bytes]] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free_plain) + len(self._untouched) + len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached_free(self) -> int:
        """Free blocks still holding a findable prefix."""
        return len(self._free_cached)

    @property
    def num_touched(self) -> int:
        """Blocks ever allocated: on a CPU, the cache's committed memory is this many blocks' worth."""
        return self.num_blocks - len(self._untouched)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} blocks, {self.num_free} free")
        plain, untouched, cached_free, refs = self._free_plain, self._untouched, self._free_cached, self._refs
        blocks = []
        for _ in range(n):
            if plain:
                block, _ = plain.popitem()
            elif untouched:
                block = untouched.pop()
            else:
                block, _ = cached_free.popitem(last=False)
                self._evict(block)
            refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        refs, cached = self._refs, self._cached
        # Freed in reverse so a sequence's tail blocks (the least shared) are evicted first.
        for block in reversed(blocks):
            count = refs[block] - 1
            if count < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            refs[block] = count
            if count == 0:
                if block in cached:
                    self._free_cached[block] = None
                else:
                    self._free_plain[block] = None

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    # ------------------------------------------------------------------ prefix cache

    def lookup(self, link: bytes) -> tuple[int, bytes] | None:
        """The cached block ``link`` finds (held or free, not yet taken) and its key. (Nothing
        is found without caching: nothing is registered.)"""
        return self._by_link.get(link)

    def num_free_among(self, blocks: list[int]) -> int:
        refs = self._refs
        return [refs[b] for b in blocks].count(0)

    def take(self, blocks: list[int]) -> None:
        """Add a reference to cached blocks (a prefix hit); free ones leave the free list."""
        refs = self._refs
        for block in blocks:
            if refs[block] == 0:
                del self._free_cached[block]  # a prefix hit finds cached blocks only
            refs[block] += 1

    def register(self, block: int, link: bytes, key: bytes) -> None:
        """``block`` now holds the computed KV of the full block with this link and key."""
        if self.enable_caching and link not in self._by_link and block not in self._cached:
            self._by_link[link] = (block, key)
            self._cached[block] = link
            if self._refs[block] == 0:  # a free block (the scheduler registers held ones)
                if block in self._free_plain:
                    del self._free_plain[block]
                else:
                    self._untouched.remove(block)
                self._free_cached[block] = None

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queries += queried_tokens
        self.hits += hit_tokens

    def reset_cache(self) -> int:
        """Forget the cached prefixes of every free block; returns how many were dropped."""
        dropped = len(self._free_cached)
        for block in self._free_cached:
            self._evict(block)
            self._free_plain[block] = None
        self._free_cached.clear()
        return dropped

    def _evict(self, block: int) -> None:
        self.evictions += 1
        link = self._cached.pop(block, None)
        if link is not None and self._by_link[link][0] == block:
            del self._by_link[link]
