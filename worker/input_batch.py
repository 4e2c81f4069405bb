"""The worker's persistent input batch: one slot per running request, its block table a row of
one int32 tensor and its sampling parameters a row of one float32 tensor, both living across
steps and changed only by the plans' deltas.

A request takes a free slot when it arrives (``add``), its row grows as plans send it blocks
(``append_blocks``), and the slot is freed when the request stops, is aborted or is forgotten
(``remove``); a preempted request that comes back gets a fresh slot and its new blocks. A
step's block tables are then one ``index_select`` of the rows it runs, cut to the widest
row (``rows``) — no Python list per row per step, which at 64 rows and a 4k context was a
list-to-tensor conversion of every row's whole table on every step of a decode window.

A step's sampling parameters are likewise one ``index_select`` of the parameter rows
(``sampler.PARAM_COLUMNS``), written once when the request takes its slot: no per-row Python
list per step.

The tables sit in pinned memory on a CUDA worker, so what a step slices from them reaches the
device in the step's one non-blocking copy (``staging.HostToDevice``, with the attention
metadata and the input ids), and in plain memory on the CPU, where they are used where they are
built.
"""

from __future__ import annotations

import dataclasses

import torch

from protocol.messages import SamplingParams
from worker.sampler import PARAM_COLUMNS, param_row


@dataclasses.dataclass
class RowTables:
    """The block tables of a step's rows: ``table[b, :num_blocks[b]]`` are row b's blocks, in
    order; the rest of the row is padding (block 0)."""

    table: torch.Tensor  # [B, widest] int32, on the host
    num_blocks: torch.Tensor  # [B] int64

    @classmethod
    def from_lists(cls, block_tables: list[list[int]]) -> RowTables:
        widest = max((len(t) for t in block_tables), default=0)
        table = torch.zeros((len(block_tables), max(widest, 1)), dtype=torch.int32)
        for i, blocks in enumerate(block_tables):
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return cls(table, torch.tensor([len(t) for t in block_tables], dtype=torch.long))


class InputBatch:
    """Slots for the requests the worker holds, each with room for ``max_blocks`` blocks.

    ``max_num_seqs`` slots of ``max_blocks`` (the model's length) are made up front. The worker
    may hold more requests than run at once (swapped-out ones keep their state), and a
    multi-step reservation may reach past the model's length: then the table grows, doubling."""

    def __init__(self, max_num_seqs: int, max_blocks: int, pin_memory: bool = False) -> None:
        self.max_blocks, self.pin_memory = max_blocks, pin_memory
        self.block_table = torch.zeros((max_num_seqs, max_blocks), dtype=torch.int32, pin_memory=pin_memory)
        self.params = torch.zeros((max_num_seqs, len(PARAM_COLUMNS)), dtype=torch.float32, pin_memory=pin_memory)
        self.num_blocks = [0] * max_num_seqs  # a list: read per row per step, cheaper than tensor items
        self.slot_of: dict[int, int] = {}
        self._free = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out the lowest slot first

    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, rid: int) -> bool:
        return rid in self.slot_of

    def add(self, rid: int, sampling: SamplingParams) -> int:
        """A slot for a new request, with an empty table; returns it."""
        if rid in self.slot_of:
            raise ValueError(f"rid {rid} already has slot {self.slot_of[rid]}")
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.slot_of[rid] = slot
        self.num_blocks[slot] = 0
        # A reused slot still holds its last occupant's blocks past the new count: cleared, so
        # a step's table pads with block 0 whoever held the slot before (kernels read only up to
        # each row's count, but padding that depends on history makes steps differ by history).
        self.block_table[slot].zero_()
        self.params[slot] = torch.tensor(param_row(sampling))
        return slot

    def _grow(self) -> None:
        rows = self.block_table.shape[0]
        self._resize(2 * rows, self.max_blocks)
        self.num_blocks += [0] * rows
        self._free = list(range(2 * rows - 1, rows - 1, -1))

    def _resize(self, rows: int, max_blocks: int) -> None:
        old = self.block_table
        self.block_table = torch.zeros((rows, max_blocks), dtype=torch.int32, pin_memory=self.pin_memory)
        self.block_table[: old.shape[0], : old.shape[1]] = old
        self.max_blocks = max_blocks
        if rows > self.params.shape[0]:
            params = torch.zeros((rows, self.params.shape[1]), dtype=torch.float32, pin_memory=self.pin_memory)
            params[: self.params.shape[0]] = self.params
            self.params = params

    def remove(self, rid: int) -> None:
        """Free the request's slot; a rid without one is ignored (already gone)."""
        slot = self.slot_of.pop(rid, None)
        if slot is not None:
            self._free.append(slot)

    def append_blocks(self, rid: int, blocks: list[int]) -> None:
        if not blocks:
            return
        slot = self.slot_of[rid]
        have = self.num_blocks[slot]
        if have + len(blocks) > self.max_blocks:  # a reservation past the model's length: widen
            self._resize(self.block_table.shape[0], max(2 * self.max_blocks, have + len(blocks)))
        self.block_table[slot, have : have + len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.num_blocks[slot] = have + len(blocks)

    def blocks_of(self, rid: int) -> int:
        return self.num_blocks[self.slot_of[rid]]

    def table_of(self, rid: int, start: int = 0) -> list[int]:
        """The request's block ids, in order, from its ``start``-th."""
        slot = self.slot_of[rid]
        return self.block_table[slot, start : self.num_blocks[slot]].tolist()

    def rows(self, rids: list[int]) -> RowTables:
        """The tables of a step's rows, in the step's order."""
        return self.gather(rids)[0]

    def gather(self, rids: list[int], sampling_rids: list[int] | None = None) -> tuple[RowTables, torch.Tensor]:
        """The block tables of a step's rows ``rids`` and the sampling parameter rows of those
        that sample (``sampling_rids``, in logits order; default: all of ``rids``)."""
        slots = [self.slot_of[rid] for rid in rids]
        counts = [self.num_blocks[s] for s in slots]
        widest = max(max(counts, default=0), 1)
        idx = torch.tensor(slots, dtype=torch.long)
        tables = RowTables(self.block_table[:, :widest].index_select(0, idx), torch.tensor(counts, dtype=torch.long))
        if sampling_rids is not None and sampling_rids != rids:
            idx = torch.tensor([self.slot_of[rid] for rid in sampling_rids], dtype=torch.long)
        return tables, self.params.index_select(0, idx)
