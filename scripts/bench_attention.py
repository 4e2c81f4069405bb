"""Per-token decode time of a whole ~100M-parameter Llama: Sluice's runner (paged KV cache,
block tables) vs transformers' own forward with its dense ``DynamicCache``, same weights, same
process, same thread count.

    python scripts/bench_attention.py                          # batch 1 16 64 x context 128 1024 4096
    python scripts/bench_attention.py --batches 16 --contexts 1024 --steps 5

Each cell starts both sides at ``context`` tokens already in the cache (filled with the same
random keys and values, not by a prefill: prefilling 64 x 4096 tokens would take this CPU far
longer than the decoding it measures) and times ``--steps`` decode steps after one untimed
warm-up step. The figure is milliseconds per decode step (one new token per sequence); the ratio
is Sluice / transformers (below 1.0: Sluice is faster). A cell whose two caches would not fit
in ``--memory-limit`` is reported as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from protocol.config import WorkerConfig
from protocol.messages import NewRequest, SamplingParams, StepPlan
from worker.engine import Worker

CONFIG = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
              num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=8192,
              rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
BLOCK = 16


def build_checkpoint(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from worker.tiny import build_byte_level_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path, safe_serialization=True)
    build_byte_level_tokenizer(CONFIG["vocab_size"]).save(str(path / "tokenizer.json"))


def kv_bytes(batch: int, context: int, steps: int) -> int:
    kv_dim = CONFIG["hidden_size"] // CONFIG["num_attention_heads"] * CONFIG["num_key_value_heads"]
    return 2 * CONFIG["num_hidden_layers"] * kv_dim * 4 * batch * (context + steps + BLOCK)


def time_sluice(path: Path, batch: int, context: int, steps: int) -> float:
    per_seq = -(-(context + steps + 2) // BLOCK)
    worker = Worker(WorkerConfig(model=str(path), num_kv_blocks=batch * per_seq + 1, block_size=BLOCK,
                                 max_num_seqs=max(batch, 1), log_level="warning"))
    for k, v in zip(worker.runner.cache.keys, worker.runner.cache.values, strict=True):
        k.normal_()
        v.normal_()
    runner = worker.runner
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    news = [NewRequest(i, [(i + j) % 1000 + 3 for j in range(context + 1)], context, params, num_computed=context)
            for i in range(batch)]
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    rids = list(range(batch))
    list(runner.execute(StepPlan(1, news, rids, [1] * batch, tables)))  # warm-up step
    start = time.perf_counter()
    list(runner.execute(StepPlan(2, [], rids, [1] * batch, [[] for _ in rids], num_steps=steps)))
    elapsed = time.perf_counter() - start
    del worker, runner
    gc.collect()
    return 1000 * elapsed / steps


def time_transformers(path: Path, batch: int, context: int, steps: int) -> float:
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kv_heads = CONFIG["num_key_value_heads"]
    head_dim = CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    cache = DynamicCache(config=model.config)
    for layer in range(CONFIG["num_hidden_layers"]):
        cache.update(torch.randn(batch, kv_heads, context, head_dim), torch.randn(batch, kv_heads, context, head_dim),
                     layer)
    ids = torch.full((batch, 1), 5, dtype=torch.long)
    with torch.inference_mode():
        position = context

        def step() -> None:
            nonlocal ids, position
            out = model(input_ids=ids, past_key_values=cache, use_cache=True,
                        position_ids=torch.full((batch, 1), position),
                        attention_mask=torch.ones((batch, position + 1), dtype=torch.long))
            ids = out.logits[:, -1].argmax(-1, keepdim=True)
            position += 1

        step()  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            step()
        elapsed = time.perf_counter() - start
    return 1000 * elapsed / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--memory-limit", type=float, default=9.0, help="GiB one side's KV cache may take")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build_checkpoint(path)
        print(f"Llama {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, "
              f"{CONFIG['num_attention_heads']} heads / {CONFIG['num_key_value_heads']} KV heads, vocab "
              f"{CONFIG['vocab_size']} (~100M parameters), float32, {torch.get_num_threads()} torch threads; "
              f"ms per decode step (one token per sequence), {args.steps} timed steps after a warm-up")
        print(f"{'batch':>6} {'context':>8} | {'sluice':>9} | {'transformers':>12} | ratio")
        for batch in args.batches:
            for context in args.contexts:
                need = kv_bytes(batch, context, args.steps) / 2**30
                if need > args.memory_limit:
                    print(f"{batch:>6} {context:>8} | skipped: each side's KV cache needs {need:.1f} GiB "
                          f"(> --memory-limit {args.memory_limit} GiB)")
                    continue
                ours = time_sluice(path, batch, context, args.steps)
                theirs = time_transformers(path, batch, context, args.steps)
                print(f"{batch:>6} {context:>8} | {ours:>9.1f} | {theirs:>12.1f} | {ours / theirs:5.2f}", flush=True)


if __name__ == "__main__":
    main()
