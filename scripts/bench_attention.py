"""Per-token decode time of a whole ~100M-parameter Llama: Sluice's runner (paged KV cache,
block tables) vs transformers' own forward with its dense ``DynamicCache``, same weights, same
process, same thread count (by default the one a Sluice worker picks), float32.

    python scripts/bench_attention.py                     # batch 1 16 64 x context 128 1024 4096
    python scripts/bench_attention.py --quick             # batch 1 16 x context 128 1024, fewer steps
    python scripts/bench_attention.py --cells 16x1024 64x4096 --steps 5

Each cell starts both sides at ``context`` tokens already in the cache (the same values on
both, written directly rather than prefilled: prefilling 64 x 4096 tokens would take this CPU
far longer than the decoding it measures). Then, ``--rounds`` times, each side decodes
``--steps`` steps (one untimed warm-up step first): Sluice as one multi-step plan, exactly as a
worker runs it; transformers as a loop of ``model(...)`` calls with greedy next ids. The sides
alternate so that load from other processes hits both alike; a side's figure is its best round,
in milliseconds per decode step (one new token per sequence). The ratio is Sluice /
transformers: below 1.0, Sluice is faster. A cell whose caches would not fit in
``--memory-limit`` is reported as infeasible, with the figure, never skipped silently.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from protocol.config import WorkerConfig
from protocol.messages import NewRequest, SamplingParams, StepPlan
from worker.cpu_threads import configure_cpu_threads
from worker.engine import Worker

CONFIG: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
    num_key_value_heads=4, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2,
)
BLOCK = 16
KV_HEADS = CONFIG["num_key_value_heads"]
HEAD_DIM = CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
LAYERS = CONFIG["num_hidden_layers"]


def build_checkpoint(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from worker.model.tiny import build_byte_level_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path, safe_serialization=True)
    build_byte_level_tokenizer(CONFIG["vocab_size"]).save(str(path / "tokenizer.json"))


def kv_bytes(batch: int, tokens: int) -> int:
    """One side's keys and values for ``batch`` sequences of ``tokens`` tokens, float32."""
    return 2 * LAYERS * KV_HEADS * HEAD_DIM * 4 * batch * tokens


def pattern(tokens: int) -> torch.Tensor:
    """[tokens, KVH, D] of random keys/values; both sides' caches are tiled with it (filling
    gigabytes with fresh random numbers would take longer than the timing)."""
    g = torch.Generator().manual_seed(1)
    return torch.randn((tokens, KV_HEADS, HEAD_DIM), generator=g)


class SluiceSide:
    def __init__(self, path: Path, batch: int, context: int, total_steps: int) -> None:
        per_seq = -(-(context + total_steps + 1) // BLOCK)
        self.worker = Worker(WorkerConfig(model=str(path), num_kv_blocks=batch * per_seq + 1, block_size=BLOCK,
                                          max_num_seqs=batch, log_level="warning"))
        self.runner = self.worker.runner
        tile = pattern(per_seq * BLOCK).view(per_seq, BLOCK, KV_HEADS, HEAD_DIM)
        for layer in self.runner.cache.layers:
            layer[1:].view(batch, per_seq, BLOCK, KV_HEADS, HEAD_DIM).copy_(tile)
        params = SamplingParams(max_tokens=total_steps + 1, temperature=0.0, ignore_eos=True)
        news = [NewRequest(i, [(i + j) % 1000 + 3 for j in range(context + 1)], context, params, num_computed=context)
                for i in range(batch)]
        self.rids = list(range(batch))
        self.plan_id = 1
        tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
        self._run(StepPlan(self.plan_id, news, self.rids, [1] * batch, tables))  # warm-up step

    def _run(self, plan: StepPlan) -> None:
        for _ in self.runner.execute(plan):
            pass

    def time_steps(self, steps: int) -> float:
        self.plan_id += 1
        plan = StepPlan(self.plan_id, [], self.rids, [1] * len(self.rids), [[] for _ in self.rids], num_steps=steps)
        start = time.perf_counter()
        self._run(plan)
        return (time.perf_counter() - start) / steps


class TransformersSide:
    def __init__(self, path: Path, batch: int, context: int) -> None:
        from transformers import AutoModelForCausalLM, DynamicCache

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.cache = DynamicCache(config=self.model.config)
        tile = pattern(context).transpose(0, 1)  # [KVH, context, D]
        for layer in range(LAYERS):
            k = tile.expand(batch, -1, -1, -1).contiguous()
            self.cache.update(k, k.clone(), layer)
        self.batch = batch
        self.position = context
        self.ids = torch.full((batch, 1), 5, dtype=torch.long)
        self.time_steps(1)  # warm-up step

    @torch.inference_mode()
    def time_steps(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            out = self.model(input_ids=self.ids, past_key_values=self.cache, use_cache=True,
                             position_ids=torch.full((self.batch, 1), self.position),
                             attention_mask=torch.ones((self.batch, self.position + 1), dtype=torch.long))
            self.ids = out.logits[:, -1].argmax(-1, keepdim=True)
            self.position += 1
        return (time.perf_counter() - start) / steps


def run_cell(path: Path, batch: int, context: int, steps: int, rounds: int) -> tuple[float, float]:
    sluice = SluiceSide(path, batch, context, steps * rounds)
    hf = TransformersSide(path, batch, context)
    ours, theirs = float("inf"), float("inf")
    for _ in range(rounds):
        ours = min(ours, sluice.time_steps(steps))
        theirs = min(theirs, hf.time_steps(steps))
    del sluice, hf
    gc.collect()
    return 1000 * ours, 1000 * theirs


def parse_cells(args: argparse.Namespace) -> list[tuple[int, int]]:
    if args.cells:
        return [(int(b), int(c)) for b, c in (cell.lower().split("x") for cell in args.cells)]
    if args.quick:
        return [(b, c) for b in (1, 16) for c in (128, 1024)]
    return [(b, c) for b in args.batches for c in args.contexts]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--cells", nargs="+", metavar="BxC", help="explicit cells, e.g. 16x1024 64x4096")
    p.add_argument("--quick", action="store_true", help="batch 1, 16 x context 128, 1024; 2 steps, 2 rounds")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per round (default 4; 2 quick)")
    p.add_argument("--rounds", type=int, default=2, help="alternating timing rounds per side; best counts")
    p.add_argument("--memory-limit", type=float, default=14.0,
                   help="GiB both sides' KV caches may take together (the machine has others' work too)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for both sides (default: what a Sluice worker uses for a 100M model)")
    args = p.parse_args()
    steps = args.steps or (2 if args.quick else 4)
    if args.threads:
        torch.set_num_threads(args.threads)
    else:
        configure_cpu_threads(torch.device("cpu"), 0, 100_000_000)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build_checkpoint(path)
        print(f"Llama: {LAYERS} layers, hidden {CONFIG['hidden_size']}, {CONFIG['num_attention_heads']} heads / "
              f"{KV_HEADS} KV heads, vocab {CONFIG['vocab_size']}, tied embeddings (100M parameters); float32 "
              f"on CPU, {torch.get_num_threads()} torch threads; ms per decode step (one new token per sequence), "
              f"best of {args.rounds} alternating rounds of {steps} steps after a warm-up step")
        print(f"{'batch':>6} {'context':>8} | {'sluice ms':>10} | {'transformers ms':>15} | ratio")
        for batch, context in parse_cells(args):
            need = 2 * kv_bytes(batch, context + steps * args.rounds + BLOCK) / 2**30
            if need > args.memory_limit:
                print(f"{batch:>6} {context:>8} | infeasible here: the two KV caches need {need:.1f} GiB "
                      f"(> --memory-limit {args.memory_limit:g} GiB)", flush=True)
                continue
            ours, theirs = run_cell(path, batch, context, steps, args.rounds)
            print(f"{batch:>6} {context:>8} | {ours:>10.1f} | {theirs:>15.1f} | {ours / theirs:5.2f}", flush=True)


if __name__ == "__main__":
    main()
