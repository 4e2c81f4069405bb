"""KV block accounting and the prefix cache. Pure Python.

Invariants:
* every block id in ``range(num_blocks)`` is either free (ref count 0, in ``_free``) or held;
* a request's block table owns one reference per block; blocks shared through the prefix cache
  have one reference per request holding them;
* a full block whose KV has been computed may be cached: ``_by_link`` finds it and its key — held
  or free — by its link (its parent's key and its tokens, see ``scheduler.request``) until it is
  reused for other tokens; ``_cached`` has its link. (A link is 32 + 8 x block size bytes:
  160 at block size 16, kept for cached blocks only. Keying the lookup by the sha256 key instead
  would need every prompt block hashed to find a hit.)

The free list is an ``OrderedDict`` used as an O(1) doubly-linked list in LRU order: freed blocks
go to the back and allocation takes from the front, so the block freed longest ago is evicted
first and recently freed cached blocks stay findable as long as possible. A cached free block
counts as free: taking it back for a prefix hit costs nothing; allocating it evicts its hash.
"""

from __future__ import annotations

from collections import OrderedDict


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    __slots__ = ("_by_link", "_cached", "_cached_free", "_free", "_refs", "enable_caching", "hits", "num_blocks",
                 "queries")

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._by_link: dict[bytes, tuple[int, bytes]] = {}  # link -> (block, key)
        self._cached: dict[int, bytes] = {}  # block -> link
        self._cached_free = 0  # free blocks still in ``_cached``: kept as a count, read every ping
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of which found

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks still holding a findable prefix."""
        return self._cached_free

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        free, refs, cached = self._free, self._refs, self._cached
        blocks = []
        for _ in range(n):
            block, _ = free.popitem(last=False)
            if block in cached:
                self._cached_free -= 1
                self._evict(block)
            refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        free, refs, cached = self._free, self._refs, self._cached
        # Freed in reverse so a sequence's tail blocks (the least shared) are evicted first.
        for block in reversed(blocks):
            count = refs[block] - 1
            if count < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            refs[block] = count
            if count == 0:
                free[block] = None
                if block in cached:
                    self._cached_free += 1

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
        refs, free, cached = self._refs, self._free, self._cached
        for block in blocks:
            if refs[block] == 0:
                del free[block]
                if block in cached:
                    self._cached_free -= 1
            refs[block] += 1

    def register(self, block: int, link: bytes, key: bytes) -> None:
        """``block`` now holds the computed KV of the full block with this link and key."""
        if self.enable_caching and link not in self._by_link and block not in self._cached:
            self._by_link[link] = (block, key)
            self._cached[block] = link
            if self._refs[block] == 0:
                self._cached_free += 1

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queries += queried_tokens
        self.hits += hit_tokens

    def reset_cache(self) -> int:
        """Forget the cached prefixes of every free block; returns how many were dropped."""
        dropped = 0
        for block in self._free:
            if block in self._cached:
                self._evict(block)
                dropped += 1
        self._cached_free -= dropped
        return dropped

    def _evict(self, block: int) -> None:
        link = self._cached.pop(block, None)
        if link is not None and self._by_link[link][0] == block:
            del self._by_link[link]
