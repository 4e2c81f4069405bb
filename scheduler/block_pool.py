"""KV block accounting: which of the worker's cache blocks each request holds. Pure Python.

Invariants:
* every block id in ``range(num_blocks)`` is either free (in ``_free``) or held (ref count >= 1);
* a request's block table owns one reference per block; ``free`` drops those references.

The free list is an ``OrderedDict`` used as an O(1) doubly-linked list in LRU order: freed blocks
go to the back and allocation takes from the front, so the block freed longest ago is reused first.
That order is what lets a prefix cache keep recently freed blocks findable for as long as possible.
"""

from __future__ import annotations

from collections import OrderedDict


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        # Freed in reverse so a sequence's tail blocks (least likely shared) are reused first.
        for block in reversed(blocks):
            refs = self._refs[block] - 1
            if refs < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self._refs[block] = refs
            if refs == 0:
                self._free[block] = None

    def ref_count(self, block: int) -> int:
        return self._refs[block]
