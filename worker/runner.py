"""ModelRunner: the worker's persistent per-request state and the execution of step plans.

Every request the worker knows has a ``SequenceState``. A ``StepPlan`` carries only deltas;
``execute`` applies it and yields one ``StepTokens`` per step as soon as that step's tokens are
on the host, so the process can forward each step at once.

Step 0 runs every row of the plan in one forward pass (prefill chunks and decodes mixed); a row
whose tokens are then all computed samples from the logits of its last position. Steps
1..n-1 (multi-step) decode the rows that sampled and have not stopped, feeding each step's
sampled ids — still on the device — into the next step's input. A row stops early on EOS / a
stop id / max_tokens / max_model_len, by the rules the scheduler applies too, emits nothing past
its stop token, and its state is dropped.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import torch

from protocol.messages import StepPlan, StepTokens
from worker.attention import AttentionMetadata
from worker.host_copy import HostCopier
from worker.kv_cache import KVCache, SwapSpace
from worker.llama import LlamaForCausalLM
from worker.sampler import Sampler, SamplerOutput, SamplingRow
from worker.sequence import PlanError, SequenceState


@dataclasses.dataclass
class StepBatch:
    """One forward pass: who computes which positions, and which rows then sample."""

    input_ids: torch.Tensor  # [T] flattened tokens of every row, on the device
    seqs: list[SequenceState]
    starts: list[int]
    lengths: list[int]
    samplers: list[SequenceState]  # rows that sample, in logits order
    logits_indices: list[int]  # flat index of each sampler's last token


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, device: torch.device, max_model_len: int,
                 eos_token_ids: list[int], max_num_seqs: int = 256, seed: int | None = None) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.sliding_window = model.config.sliding_window
        self.seqs: dict[int, SequenceState] = {}
        self.sampler = Sampler(device, eos_token_ids, seed)
        self.copier = HostCopier(device, max_num_seqs)
        self.swap_space = SwapSpace(cache)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> Iterator[StepTokens]:
        """Run ``plan``; yields one ``StepTokens`` per step, exactly one of them ``last``.

        ``busy_s`` counts the worker's own time for the step (input building, forward, sampling,
        copy to host), not the time the consumer holds the generator between steps."""
        began = time.perf_counter()
        self._apply_deltas(plan)
        batch = self._first_batch(plan)
        num_steps = max(1, plan.num_steps)
        for step in range(num_steps):
            out = self._forward(batch) if batch is not None else None
            if out is None or batch is None:  # nothing ran, or only prefill chunks that sample nothing
                yield StepTokens(plan.plan_id, step, [], [], True, time.perf_counter() - began)
                return
            tokens = self.copier.start(out.token_ids).result()
            logprobs = out.logprobs.to_wire(len(tokens)) if out.logprobs is not None else None
            still = [i for i, (seq, token) in enumerate(zip(batch.samplers, tokens, strict=True))
                     if not self._append(seq, token)]
            last = step == num_steps - 1 or not still
            yield StepTokens(plan.plan_id, step, [s.rid for s in batch.samplers], tokens, last,
                             time.perf_counter() - began, logprobs)
            if last:
                return
            began = time.perf_counter()
            batch = self._decode_batch(batch, out.token_ids, still)

    # ------------------------------------------------------------------ plan application

    def _apply_deltas(self, plan: StepPlan) -> None:
        for rid in plan.forget:
            self.seqs.pop(rid, None)
        for new in plan.new_requests:
            self.seqs[new.rid] = SequenceState.from_new(new)
        # Block moves come before the forward pass that may read them, in the protocol's order.
        self.swap_space.swap_out(plan.swap_out)
        self.swap_space.swap_in(plan.swap_in)
        self.cache.copy_blocks(plan.copy_blocks)

    def _first_batch(self, plan: StepPlan) -> StepBatch | None:
        if not len(plan.rids) == len(plan.num_tokens) == len(plan.new_block_ids):
            raise PlanError(f"plan {plan.plan_id}: rids, num_tokens and new_block_ids differ in length")
        if len(set(plan.rids)) != len(plan.rids):
            raise PlanError(f"plan {plan.plan_id}: a request appears twice")
        if not plan.rids:
            return None
        ids: list[int] = []
        seqs, starts, samplers, logits_indices = [], [], [], []
        for rid, n, new_blocks in zip(plan.rids, plan.num_tokens, plan.new_block_ids, strict=True):
            seq = self.seqs.get(rid)
            if seq is None:
                raise PlanError(f"plan {plan.plan_id}: unknown rid {rid} (never sent, or forgotten)")
            seq.block_table.extend(new_blocks)
            start = seq.schedule(n, self.cache.block_size)
            ids.extend(seq.token_ids[start : start + n])
            seqs.append(seq)
            starts.append(start)
            if seq.fully_computed:
                samplers.append(seq)
                logits_indices.append(len(ids) - 1)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return StepBatch(input_ids, seqs, starts, list(plan.num_tokens), samplers, logits_indices)

    def _decode_batch(self, prev: StepBatch, sampled: torch.Tensor, keep: list[int]) -> StepBatch:
        """The next multi-step step: rows ``keep`` of the previous samplers each compute the
        token they just sampled, taken from ``sampled`` without leaving the device."""
        seqs = [prev.samplers[i] for i in keep]
        if len(keep) < len(prev.samplers):
            sampled = sampled[torch.tensor(keep, device=sampled.device)]
        starts = [seq.schedule(1, self.cache.block_size) for seq in seqs]
        return StepBatch(sampled, seqs, starts, [1] * len(seqs), seqs, list(range(len(seqs))))

    # ------------------------------------------------------------------ one step

    def _forward(self, batch: StepBatch) -> SamplerOutput | None:
        meta = AttentionMetadata.build(self.cache, [s.block_table for s in batch.seqs], batch.starts,
                                       batch.lengths, batch.logits_indices, self.device, self.sliding_window)
        logits = self.model(batch.input_ids, meta)
        if not batch.samplers:
            return None
        return self.sampler(logits, [SamplingRow(s.sampling, s.num_outputs) for s in batch.samplers])

    def _append(self, seq: SequenceState, token: int) -> bool:
        """Record a sampled token; a request that stops with it is forgotten at once."""
        stopped = seq.append(token, self.eos_token_ids, self.max_model_len)
        if stopped:
            self.seqs.pop(seq.rid, None)
        return stopped
