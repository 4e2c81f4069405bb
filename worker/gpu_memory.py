"""How much of a GPU the KV cache may take: measured by a profiling run, not guessed.

The cache gets what ``--gpu-memory-utilization`` of the device leaves once the weights, the
largest step's activations and CUDA's own memory (its context, cuBLAS's and FlashInfer's
workspaces) are counted. The activations are measured: before the cache is sized, the worker
runs the largest step the scheduler can send — ``--max-num-batched-tokens`` tokens split over up
to ``--max-num-seqs`` rows, every row sampling — on a provisional cache just big enough for it,
and reads torch's peak allocation (vLLM sizes its cache the same way). The old rule, 90% of the
free memory less a fixed 1 GiB, was right only for models whose activations happened to fit in
1 GiB, and took the whole device whatever else ran on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from protocol.config import ConfigError
from protocol.messages import NewRequest, SamplingParams, StepPlan
from worker.kv_cache import KVCache

PROFILE_RID = -100  # and below: rids the frontend assigns are >= 0, the warm-up's -1 and -2
# Without paged kernels attention gathers each row's context (and SDPA may build its scores):
# memory that grows with the context, beyond what a profile of short prompts shows.
GATHER_MARGIN_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class MemoryProfile:
    total: int  # the device's memory
    allocated: int  # torch's allocations before the profiling run: the weights, mostly
    activation_peak: int  # the largest step's peak beyond them and the provisional cache
    non_torch: int  # what CUDA holds outside torch's allocator (context, library workspaces)


def kv_budget(profile: MemoryProfile, utilization: float) -> int:
    """Bytes for the KV cache: ``utilization`` of the device less everything else measured."""
    return int(profile.total * utilization) - profile.allocated - profile.activation_peak - profile.non_torch


def explain(profile: MemoryProfile, utilization: float) -> str:
    gib = 2**30
    return (f"--gpu-memory-utilization {utilization:g} of {profile.total / gib:.1f} GiB, less weights "
            f"{profile.allocated / gib:.2f} GiB, activations {profile.activation_peak / gib:.2f} GiB (profiled), "
            f"CUDA's own {profile.non_torch / gib:.2f} GiB")


def start_profile(device: torch.device) -> None:
    """Everything queued has run, and the peak counts from here."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)


def measure(device: torch.device, provisional_cache_bytes: int, allocated_before: int) -> MemoryProfile:
    """What the step run since ``start_profile`` (on a provisional cache of
    ``provisional_cache_bytes``, already allocated) used beyond ``allocated_before``."""
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return MemoryProfile(total, allocated_before, max(0, peak - allocated_before - provisional_cache_bytes), non_torch)


def largest_step(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int
                 ) -> tuple[int, int, int]:
    """(rows, tokens per row, blocks per row) of the largest step the scheduler can send: its
    token budget over as many rows as it may run, every row sampling."""
    tokens = max(1, max_num_batched_tokens)
    rows = max(1, min(max_num_seqs, tokens))
    per_row = max(1, min(tokens // rows, max_model_len - 1))
    return rows, per_row, -(-per_row // block_size)


def profiling_plan(rows: int, per_row: int, blocks_per_row: int) -> StepPlan:
    """One step: ``rows`` prompts of ``per_row`` tokens on their own blocks (block 0 left out),
    each sampling one token on the sampler's widest path: top-p without top-k (on CUDA, a sort
    of the whole vocabulary per row), penalties (each request's counts over the vocabulary, kept
    while it runs) and logprobs."""
    sampling = SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, logprobs=20, repetition_penalty=1.1,
                              frequency_penalty=0.1, ignore_eos=True)
    rids = [PROFILE_RID - i for i in range(rows)]
    news = [NewRequest(rid, [1 + (i + j) % 100 for j in range(per_row)], per_row, sampling) for i, rid in enumerate(rids)]
    tables = [list(range(1 + i * blocks_per_row, 1 + (i + 1) * blocks_per_row)) for i in range(rows)]
    return StepPlan(PROFILE_RID, news, rids, [per_row] * rows, tables)


def cuda_kv_blocks(device: torch.device, utilization: float, per_block: int, make_cache: Callable[[int], KVCache],
                   run_plan: Callable[[KVCache, StepPlan], bool], max_num_batched_tokens: int, max_num_seqs: int,
                   max_model_len: int, block_size: int) -> tuple[int, str]:
    """KV blocks for a CUDA worker, and the reason for the log: the profiling run above, of two
    shapes (the token budget over the most rows; all of it in one row, whose attention is the
    widest). ``run_plan`` says whether its attention read the cache in place (FlashInfer);
    where it gathered the context instead, attention's memory grows with the context, which no
    short profile shows, and ``GATHER_MARGIN_BYTES`` more are kept back."""
    shapes = {largest_step(max_num_batched_tokens, max_num_seqs, max_model_len, block_size),
              largest_step(max_num_batched_tokens, 1, max_model_len, block_size)}
    torch.cuda.empty_cache()
    allocated = torch.cuda.memory_allocated(device)
    profiles, in_place = [], True
    for rows, per_row, blocks_per_row in sorted(shapes):
        trial = make_cache(rows * blocks_per_row + 1)
        start_profile(device)
        in_place = run_plan(trial, profiling_plan(rows, per_row, blocks_per_row)) and in_place
        profiles.append(measure(device, trial.nbytes, allocated))
        del trial  # the provisional cache goes before the next one, and before the real one
        torch.cuda.empty_cache()
    profile = max(profiles, key=lambda p: p.activation_peak + p.non_torch)
    if not in_place:
        profile = dataclasses.replace(profile, activation_peak=profile.activation_peak + GATHER_MARGIN_BYTES)
    budget = kv_budget(profile, utilization)
    why = explain(profile, utilization) + ("" if in_place else
                                           f" (with {GATHER_MARGIN_BYTES / 2**30:.0f} GiB kept for gathered contexts)")
    if budget < per_block:
        raise ConfigError(f"no room for the KV cache: {why} leave {max(budget, 0) / 2**20:.0f} MiB, less than one "
                          f"block ({per_block} bytes); raise --gpu-memory-utilization, or lower "
                          "--max-num-batched-tokens / --max-num-seqs")
    return budget // per_block, f"auto: {why}"
