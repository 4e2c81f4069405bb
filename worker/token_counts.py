"""What the penalties read of each penalised request's history, kept on the device in one table.

A request whose sampling reads its history (repetition, frequency or presence penalty) holds one
row of two ``[capacity, V]`` tables: how often each token occurs among its outputs (float32), and
whether it occurs in its prompt or outputs (bool). All rows of a step are handled at once, a
fixed handful of kernels however many rows there are: a new row is filled from its history with
one ``scatter_add_`` for every new row of the step, and every row takes the token it just sampled
with one more (the per-row index_add and generator it replaced launched several kernels a row, a
thousand a step at 256 rows).

A row's life, on the host: ``assign`` (when a step is prepared: the row index travels in the
step's staged copy) -> ``filled`` (once its history is in; a row assigned again before that is
filled again, which writes the same values) -> ``release`` (the request stopped, or will be sent
again). On the device everything is in stream order, so a released row is reused only after
every kernel that touched it. Rows of requests with no ``rid`` (a caller that keeps no state
between steps) are ``assign``-ed as ``transient`` and released after the step reads them.

The tables grow by a quarter at a time (a copy each time; at most a quarter of them unused) and
never shrink: at their largest, every row the scheduler may run penalised, they are what the
profiling step of ``worker.gpu_memory`` measured, every row there penalised.
"""

from __future__ import annotations

import torch


class TokenCounts:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: dict[int, int] = {}  # rid -> its row, filled
        self.pending: dict[int, int] = {}  # rid -> its row, assigned, history not scattered yet
        self.free: list[int] = []
        self.used = 0  # rows ever handed out: the table's needed capacity
        self.output_counts: torch.Tensor | None = None  # [capacity, V] float32
        self.seen: torch.Tensor | None = None  # [capacity, V] bool
        self._ones = torch.empty(0, device=device)

    # ------------------------------------------------------------------ host bookkeeping

    def assign(self, rid: int | None) -> tuple[int, bool]:
        """The row of request ``rid`` (None: a transient one), and whether its history must be
        scattered into it this step."""
        if rid is not None and rid in self.rows:
            return self.rows[rid], False
        if rid is not None and rid in self.pending:
            return self.pending[rid], True
        row = self.free.pop() if self.free else self._new_row()
        if rid is not None:
            self.pending[rid] = row
        return row, True

    def filled(self, rids: list[int]) -> None:
        for rid in rids:
            row = self.pending.pop(rid, None)
            if row is not None:
                self.rows[rid] = row

    def release(self, rid: int) -> None:
        row = self.rows.pop(rid, None)
        if row is None:
            row = self.pending.pop(rid, None)
        if row is not None:
            self.free.append(row)

    def release_rows(self, rows: list[int]) -> None:
        self.free.extend(rows)

    def _new_row(self) -> int:
        self.used += 1
        return self.used - 1

    # ------------------------------------------------------------------ the device tables

    def fill(self, rows: torch.Tensor, ids: torch.Tensor | None, id_rows: torch.Tensor | None,
             output_weights: torch.Tensor | None, vocab: int) -> None:
        """Rows ``rows`` [N] start over from their histories: ``ids`` [H] (every row's prompt and
        outputs, one after the other), ``id_rows`` [H] the row of each, ``output_weights`` [H]
        1.0 for an output token (counted) and 0.0 for a prompt token (only seen)."""
        counts, seen = self._tables(vocab)
        counts.index_fill_(0, rows, 0.0)
        seen.index_fill_(0, rows, False)
        if ids is not None and ids.numel():
            assert id_rows is not None and output_weights is not None
            flat = id_rows * vocab + ids
            counts.view(-1).scatter_add_(0, flat, output_weights)
            seen.view(-1).index_fill_(0, flat, True)

    def read(self, rows: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[R, V] counts and seen of ``rows``."""
        counts, seen = self._tables(vocab)
        return counts.index_select(0, rows), seen.index_select(0, rows)

    def bump(self, rows: torch.Tensor, tokens: torch.Tensor, vocab: int) -> None:
        """Row ``rows[i]`` takes ``tokens[i]``, just sampled: one more occurrence, and seen. A
        row appears at most once: each samples one token a step."""
        counts, seen = self._tables(vocab)
        if self._ones.numel() < rows.numel():
            self._ones = torch.ones(max(rows.numel(), 2 * self._ones.numel(), 64), device=self.device)
        flat = rows * vocab + tokens
        counts.view(-1).scatter_add_(0, flat, self._ones[: rows.numel()])
        seen.view(-1).index_fill_(0, flat, True)

    def _tables(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        counts, seen = self.output_counts, self.seen
        if counts is not None and counts.shape[1] != vocab:
            raise ValueError(f"penalty counts are kept for a vocabulary of {counts.shape[1]}, not {vocab}")
        if counts is not None and seen is not None and counts.shape[0] >= self.used:
            return counts, seen
        held = counts.shape[0] if counts is not None else 0
        capacity = max(self.used, held + max(8, held // 4))  # a quarter more: little held unused, few copies
        grown = torch.zeros(capacity, vocab, device=self.device)
        grown_seen = torch.zeros(capacity, vocab, dtype=torch.bool, device=self.device)
        if counts is not None and seen is not None:
            grown[: counts.shape[0]] = counts
            grown_seen[: seen.shape[0]] = seen
        self.output_counts, self.seen = grown, grown_seen
        return grown, grown_seen
