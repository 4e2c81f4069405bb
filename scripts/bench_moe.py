"""What a decode step of a mixture of experts costs against its dense equivalent in active parameters.

    python scripts/bench_moe.py                       # 1, 16 and 64 rows, 3 rounds
    python scripts/bench_moe.py --rows 1 64 --dtype bfloat16 --rounds 5

Builds two random checkpoints with ``transformers`` (same shape but for the feed-forward part):
a Qwen3-MoE (``--experts`` experts of ``--expert-width`` rows, ``--top-k`` per token) and a dense
Qwen3 whose MLP is ``top_k * expert_width`` wide, so a token passes through as many feed-forward
weights in both. Each is loaded by Sluice's worker and its runner is driven directly in this
process (no server): ``--rows`` sequences prefilled, then decode steps of 8 timed; a figure is the
median milliseconds per step over ``--rounds``, the two models interleaved. Also printed: how
many experts a step ran per layer on average (at 1 row, ``top_k``; at many rows, nearly all).

What the ratio means: a decode step reads the weights of every expert some row chose, so at one
row the mixture reads about as much as the dense model (plus the router), and as rows grow it
reads up to all ``experts`` of them; the dense model's read stays the same. The mixture runs
operator by operator (the whole-stack C decoder has no expert stage), so the dense model is
also timed that way (``dense, per operator``): the ratio against it is the experts' own cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from protocol.config import WorkerConfig
from protocol.messages import NewRequest, SamplingParams, StepPlan
from worker.engine import Worker
from worker.model.llama import SparseMoE
from worker.model.tiny import build_byte_level_tokenizer

STEPS = 8  # decode steps per plan, as the server's multi-step windows run them


def save(path: Path, args: argparse.Namespace, moe: bool) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(vocab_size=4096, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=args.hidden // 8, max_position_embeddings=2048,
                 bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    if moe:
        config = Qwen3MoeConfig(**shape, intermediate_size=args.top_k * args.expert_width,
                                moe_intermediate_size=args.expert_width, num_experts=args.experts,
                                num_experts_per_tok=args.top_k, norm_topk_prob=True)
        model = Qwen3MoeForCausalLM(config)
        with torch.no_grad():  # routers that route (they start at zero)
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0, 0.5)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape, intermediate_size=args.top_k * args.expert_width))
    model.save_pretrained(path)
    build_byte_level_tokenizer(4096).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "</s>"}))
    return path


class Bench:
    def __init__(self, path: Path, dtype: str, rows: int, per_operator: bool = False) -> None:
        self.worker = Worker(WorkerConfig(model=str(path), dtype=dtype, num_kv_blocks=rows * 8 + 8, block_size=16,
                                          max_num_seqs=max(rows, 1), log_level="warning"))
        self.rows = rows
        if per_operator:  # the dense model as the mixture runs: no whole-stack C decoder
            self.worker.runner.model.cpu_decoder = None
        self.next_block = 0
        self.plan_id = 0

    def _blocks(self, n: int) -> list[int]:
        blocks = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return blocks

    def step_ms(self, rounds: int) -> float:
        """Milliseconds per decode step (median over ``rounds`` windows of ``STEPS``, after one
        to warm up), the rows prefilled first and forgotten after."""
        runner = self.worker.runner
        self.next_block = 0  # the last call's rows are forgotten: their blocks are free again
        params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
        prompt_len = 64
        rids = list(range(self.rows))
        news = [NewRequest(rid, [3 + (rid * 7 + i) % 4000 for i in range(prompt_len)], prompt_len, params)
                for rid in rids]
        budget = prompt_len + (rounds + 1) * STEPS + 1
        self.plan_id += 1
        list(runner.execute(StepPlan(self.plan_id, news, rids, [prompt_len] * self.rows,
                                     [self._blocks(-(-budget // 16)) for _ in rids], 1)))
        times = []
        for _ in range(rounds + 1):  # the first window warms up
            self.plan_id += 1
            start = time.perf_counter()
            list(runner.execute(StepPlan(self.plan_id, [], rids, [1] * self.rows, [[] for _ in rids], STEPS)))
            times.append((time.perf_counter() - start) / STEPS * 1e3)
        list(runner.execute(StepPlan(self.plan_id + 1, [], [], [], [], 1, forget=rids)))
        self.plan_id += 1
        return statistics.median(times[1:])

    def experts_per_layer(self) -> float:
        """How many experts a decode step ran per layer, on average (one untimed window, hooked)."""
        counts: list[int] = []

        def count(m: torch.nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            assert isinstance(m, SparseMoE)
            if inputs[0].shape[0] != self.rows:
                return  # the prefill's
            chosen = torch.topk(m.gate(inputs[0]).float(), m.top_k, dim=-1).indices
            counts.append(int(torch.unique(chosen).numel()))

        layers = [layer.mlp for layer in self.worker.runner.model.model.decoder_layers()]
        hooks = [m.register_forward_hook(count) for m in layers if isinstance(m, SparseMoE)]
        try:
            self.step_ms(1)
        finally:
            for hook in hooks:
                hook.remove()
        return statistics.mean(counts) if counts else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-width", type=int, default=384)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sluice-bench-moe-"))
    paths = {"moe": save(root / "moe", args, True), "dense": save(root / "dense", args, False)}
    print(f"hidden {args.hidden}, {args.layers} layers; mixture: {args.experts} experts of {args.expert_width} rows, "
          f"{args.top_k} per token; dense: an MLP of {args.top_k * args.expert_width} rows; dtype {args.dtype}; "
          f"{torch.get_num_threads()} threads")
    print(f"{'rows':>5} {'dense ms/step':>14} {'dense, per operator':>22} {'mixture ms/step':>16} {'ratio':>7} "
          f"{'vs per-op':>11} {'experts run/layer':>18}")
    for rows in args.rows:
        benches = {"dense": Bench(paths["dense"], args.dtype, rows),
                   "dense-op": Bench(paths["dense"], args.dtype, rows, per_operator=True),
                   "moe": Bench(paths["moe"], args.dtype, rows)}
        figures: dict[str, list[float]] = {name: [] for name in benches}
        for _ in range(args.rounds):
            for name, bench in benches.items():
                figures[name].append(bench.step_ms(1))
        dense, dense_op, moe = (statistics.median(figures[n]) for n in ("dense", "dense-op", "moe"))
        run = benches["moe"].experts_per_layer()
        print(f"{rows:>5} {dense:>14.2f} {dense_op:>22.2f} {moe:>16.2f} {moe / dense:>6.2f}x {moe / dense_op:>10.2f}x "
              f"{run:>18.1f}", flush=True)


if __name__ == "__main__":
    main()
