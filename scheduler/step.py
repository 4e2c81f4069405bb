"""One step's plan in the making: its rows, the token budget they leave, and the block moves the
worker makes before the forward pass."""

from __future__ import annotations

from scheduler.request import Request


class Step:
    """``rows`` maps each row's request to the tokens it computes, in the order scheduled:
    membership, a row's tokens and dropping a row are O(1)."""

    __slots__ = ("budget", "copies", "copy_sources", "rows", "swap_in", "swap_out", "swapped_in_from")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.rows: dict[Request, int] = {}
        self.swap_out: list[tuple[int, int]] = []  # (device block, host block)
        self.swap_in: list[tuple[int, int]] = []  # (host block, device block)
        self.copies: list[tuple[int, int]] = []  # (src, dst) device blocks: copy-on-write
        # Copy-on-write sources held for the step: the worker copies after its swap-ins, so a
        # source another admission could allocate (as a swap-in target) must stay taken.
        self.copy_sources: list[int] = []
        # Host blocks this step's swap-ins read, held until the step is planned: the worker runs a
        # plan's swap-outs before its swap-ins, so a swap-out later in the same step must not be
        # handed one of them (it would overwrite the KV before it is read back).
        self.swapped_in_from: list[int] = []

    def add(self, req: Request, num_tokens: int) -> None:
        self.rows[req] = num_tokens
        self.budget -= num_tokens

    def has(self, req: Request) -> bool:
        return req in self.rows

    def tokens_of(self, req: Request) -> int:
        return self.rows.get(req, 0)

    def drop(self, req: Request) -> None:
        """``req`` leaves the step (preempted): its tokens go back to the budget, and no copy
        lands in its blocks, which are about to have a new owner."""
        self.budget += self.rows.pop(req, 0)
        if self.copies:
            mine = set(req.blocks)
            self.copies = [(src, dst) for src, dst in self.copies if dst not in mine]
