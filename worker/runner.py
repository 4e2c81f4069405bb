"""ModelRunner: the worker's persistent batch state and the execution of step plans.

Every request the worker knows has a ``SequenceState`` (tokens so far, computed count, block
table, sampling). A ``StepPlan`` carries only deltas; ``execute`` applies it and yields one
``StepTokens`` per step as soon as that step's tokens are on the host.

Step 0 runs every row of the plan in one forward pass (prefill chunks and decodes mixed). Steps
1..n-1 (multi-step) decode the rows that sampled, feeding each step's sampled ids — still on the
device — into the next step. A row stops early on EOS / a stop id / max_tokens / max_model_len,
by the same rules the scheduler applies, and emits nothing past its stop.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import torch

from protocol.messages import SamplingParams, StepPlan, StepTokens
from worker.attention import AttentionMetadata, KVCache
from worker.llama import LlamaForCausalLM
from worker.sampler import SamplingRow, sample


@dataclasses.dataclass
class SequenceState:
    rid: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    num_computed: int = 0
    block_table: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class HostCopier:
    """Device-to-host copy of each step's sampled ids.

    On CUDA the copy goes to a pinned buffer on a side stream and is fenced by an event, so the
    compute stream never waits for the host; ``wait`` blocks only the thread that needs the ids.
    On the CPU the same calls degenerate to a plain copy.
    """

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        if self.cuda:
            self.stream = torch.cuda.Stream(device=device)
            self.pinned = torch.empty(capacity, dtype=torch.long, pin_memory=True)

    def start(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None, int]:
        if not self.cuda:
            return ids, None, 0
        n = ids.shape[0]
        if n > self.pinned.shape[0]:
            self.pinned = torch.empty(n, dtype=torch.long, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(self.stream):
            self.pinned[:n].copy_(ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        ids.record_stream(self.stream)
        return ids, event, n

    def wait(self, handle: tuple[torch.Tensor, torch.cuda.Event | None, int]) -> list[int]:
        ids, event, n = handle
        if event is None:
            return [int(t) for t in ids.tolist()]
        event.synchronize()
        return [int(t) for t in self.pinned[:n].tolist()]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, device: torch.device, max_model_len: int,
                 eos_token_ids: list[int], max_num_seqs: int = 256) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.seqs: dict[int, SequenceState] = {}
        self.copier = HostCopier(device, max_num_seqs)
        self.host_cache: KVCache | None = None  # swap space, allocated on the first swap

    # ------------------------------------------------------------------ plan application

    def _apply_deltas(self, plan: StepPlan) -> None:
        for rid in plan.forget:
            self.seqs.pop(rid, None)
        for new in plan.new_requests:
            self.seqs[new.rid] = SequenceState(new.rid, list(new.token_ids), new.num_prompt_tokens, new.sampling,
                                               new.num_computed)
        if plan.swap_out or plan.swap_in:
            if self.host_cache is None:
                self.host_cache = self.cache.host_copy()
            if plan.swap_out:
                self.cache.swap(self.host_cache, plan.swap_out, to_host=True)
            if plan.swap_in:
                self.cache.swap(self.host_cache, plan.swap_in, to_host=False)
        if plan.copy_blocks:
            self.cache.copy_blocks(plan.copy_blocks)

    def _stopped(self, seq: SequenceState, token: int) -> bool:
        p = seq.sampling
        if token in p.stop_token_ids:
            return True
        if not p.ignore_eos and token in self.eos_token_ids and seq.num_outputs >= p.min_tokens:
            return True
        return seq.num_outputs >= p.max_tokens or len(seq.token_ids) >= self.max_model_len

    # ------------------------------------------------------------------ execution

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> Iterator[StepTokens]:
        self._apply_deltas(plan)
        rows = [self.seqs[rid] for rid in plan.rids]
        input_ids: list[int] = []
        starts, lengths, logits_idx = [], [], []
        sampling_rows: list[SequenceState] = []
        for seq, n, new_blocks in zip(rows, plan.num_tokens, plan.new_block_ids, strict=True):
            seq.block_table.extend(new_blocks)
            start = seq.num_computed
            input_ids.extend(seq.token_ids[start : start + n])
            starts.append(start)
            lengths.append(n)
            seq.num_computed += n
            if seq.num_computed == len(seq.token_ids):
                logits_idx.append(len(input_ids) - 1)
                sampling_rows.append(seq)
        tokens_dev: torch.Tensor | None = None
        active: list[SequenceState] = []
        for step in range(plan.num_steps):
            began = time.perf_counter()
            if step == 0:
                if not rows:
                    yield StepTokens(plan.plan_id, 0, [], [], True, 0.0)
                    return
                ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
                tables = [s.block_table for s in rows]
                active = sampling_rows
            else:
                assert tokens_dev is not None
                ids = tokens_dev
                starts = [s.num_computed for s in active]
                lengths = [1] * len(active)
                logits_idx = list(range(len(active)))
                tables = [s.block_table for s in active]
                for s in active:
                    s.num_computed += 1  # this step computes the token sampled last step
            if not active:  # only partial prefills: compute, sample nothing
                self._forward(ids, tables, starts, lengths, [])
                yield StepTokens(plan.plan_id, step, [], [], True, time.perf_counter() - began)
                return
            logits = self._forward(ids, tables, starts, lengths, logits_idx)
            sampled = sample(logits, [SamplingRow(s.sampling, s.num_outputs, self.eos_token_ids) for s in active])
            host = self.copier.wait(self.copier.start(sampled))
            still: list[int] = []
            for i, (seq, token) in enumerate(zip(active, host, strict=True)):
                seq.token_ids.append(token)
                if self._stopped(seq, token):
                    self.seqs.pop(seq.rid, None)
                else:
                    still.append(i)
            last = step == plan.num_steps - 1 or not still
            yield StepTokens(plan.plan_id, step, [s.rid for s in active], host, last, time.perf_counter() - began)
            if last:
                return
            if len(still) < len(active):
                sampled = sampled[torch.tensor(still, device=self.device)]
                active = [active[i] for i in still]
            tokens_dev = sampled

    def _forward(self, ids: torch.Tensor, tables: list[list[int]], starts: list[int], lengths: list[int],
                 logits_idx: list[int]) -> torch.Tensor:
        meta = AttentionMetadata.build(self.cache, tables, starts, lengths, logits_idx, self.device)
        return self.model(ids, meta)
