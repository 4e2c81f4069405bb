"""KV block accounting and the prefix cache. Pure Python.

Invariants:
* every block id in ``range(num_blocks)`` is either free (ref count 0, in ``_free``) or held;
* a request's block table owns one reference per block; blocks shared through the prefix cache
  have one reference per request holding them;
* a full block whose KV has been computed may carry a hash, the prefix-cache key of its tokens and
  its whole prefix (``scheduler.request.block_keys``);
  ``_by_hash`` finds it — held or free — until it is reused for other tokens.

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
    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
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
        return sum(1 for b in self._free if self._hash_of[b] is not None)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        # Freed in reverse so a sequence's tail blocks (the least shared) are evicted first.
        for block in reversed(blocks):
            refs = self._refs[block] - 1
            if refs < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self._refs[block] = refs
            if refs == 0:
                self._free[block] = None

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    # ------------------------------------------------------------------ prefix cache

    def match(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (not yet taken)."""
        found: list[int] = []
        if not self.enable_caching:
            return found
        by_hash = self._by_hash
        for h in hashes:
            block = by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def num_free_among(self, blocks: list[int]) -> int:
        refs = self._refs
        return [refs[b] for b in blocks].count(0)

    def take(self, blocks: list[int]) -> None:
        """Add a reference to cached blocks (a prefix hit); free ones leave the free list."""
        refs, free = self._refs, self._free
        for block in blocks:
            if refs[block] == 0:
                del free[block]
            refs[block] += 1

    def register(self, block: int, block_hash: bytes) -> None:
        """``block`` now holds the computed KV of the full block ``block_hash`` names."""
        if self.enable_caching and block_hash not in self._by_hash and self._hash_of[block] is None:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queries += queried_tokens
        self.hits += hit_tokens

    def reset_cache(self) -> int:
        """Forget the hashes of every free block; returns how many were dropped."""
        dropped = 0
        for block in self._free:
            if self._hash_of[block] is not None:
                self._evict(block)
                dropped += 1
        return dropped

    def _evict(self, block: int) -> None:
        h = self._hash_of[block]
        if h is not None:
            self._hash_of[block] = None
            if self._by_hash.get(h) == block:
                del self._by_hash[h]
