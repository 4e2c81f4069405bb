"""Decode speed per model family: Sluice and llama.cpp serving the same GGUF file, and
``transformers`` on the same weights, in one run.

    python scripts/bench_families.py --llama-server ~/llama.cpp/build/bin/llama-server
    python scripts/bench_families.py --families qwen3 olmoe --concurrency 1 16 --rounds 2 --llama-server ...

No hub here: each family's model is random, built with ``transformers``' own class at the shape
of a small released model of the family (Qwen3-0.6B's, Gemma 3 1B's, ...; every vocabulary cut to
32,000 ids, so that building and writing a dozen models stays quick), saved as safetensors and
written as a GGUF file with its matrices in Q8_0, as llama.cpp's converter lays its tensors out
(``tests/test_gguf_families.py``'s writer). Then, for each concurrency ``c``:

* Sluice (``sluice serve --model file.gguf``, its defaults) and llama.cpp's ``llama-server`` on
  that file (all cores, one slot per stream, 512 tokens of context per slot), each started fresh
  per family, the same client: ``c`` streaming completions of ``--prompt-tokens`` token ids, each
  generating exactly ``--output-tokens`` (``ignore_eos``); output tokens/s over the cell;
* ``transformers`` (``generate``, greedy, bfloat16, batch ``c``) on the safetensors: decode
  tokens/s, the generation of one token subtracted (so its prefill does not count).

Cells are interleaved (Sluice, llama.cpp) ``--rounds`` times; a figure is the median. Random
weights decode as fast as trained ones (the same arithmetic), but their text is noise: this
measures speed, and the parity tests measure correctness.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from bench_serve import _free_port
from bench_smollm2 import Server, _cell
from gguf import GGMLQuantizationType
from test_gguf_families import write_qwen_gguf

from worker.model.tiny import build_byte_level_tokenizer

VOCAB = 32_000


def _dense(**extra: Any) -> dict[str, Any]:
    """Qwen3-0.6B's shape (hidden 1,024, 28 layers, 16 query / 8 KV heads, MLP 3,072)."""
    return dict(vocab_size=VOCAB, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=True) | extra


def _gemma(**extra: Any) -> dict[str, Any]:
    """Gemma 3 1B's shape (hidden 1,152, 26 layers, 4 query / 1 KV heads of 256, MLP 6,912)."""
    return _dense(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=256, sliding_window=512, pad_token_id=0) | extra


def _moe(**extra: Any) -> dict[str, Any]:
    """A mixture of Qwen3-MoE's and OLMoE's kind: 64 experts of 256 rows, 8 per token, 16 layers
    (about 0.9B parameters, 0.2B of them active for a token)."""
    return _dense(num_hidden_layers=16, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
                  norm_topk_prob=True, tie_word_embeddings=False) | extra


# family -> (transformers config and model class names, config fields, GGUF architecture)
FAMILIES: dict[str, tuple[str, str, Callable[[], dict[str, Any]], str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", lambda: _dense(num_hidden_layers=24), "llama"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", lambda: _dense(num_hidden_layers=24), "qwen2"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", lambda: _dense(head_dim=128), "qwen3"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", lambda: _dense(
        num_hidden_layers=24, pad_token_id=0, original_max_position_embeddings=4096,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 4096,
                         "short_factor": [1.0] * 32, "long_factor": [1.0] * 32}), "phi3"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", lambda: _gemma(query_pre_attn_scalar=256), "gemma2"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", lambda: _gemma(query_pre_attn_scalar=256), "gemma3"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", lambda: _moe(head_dim=64), "qwen3moe"),
    # OLMoE's own attention: as many KV heads as query heads (llama.cpp reads no other kind)
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", lambda: _moe(intermediate_size=256, norm_topk_prob=False,
                                                              num_key_value_heads=16), "olmoe"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", lambda: _dense(
        num_hidden_layers=16, intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2,
        tie_word_embeddings=False), "llama"),
}


def build(family: str, root: Path) -> tuple[Path, Path]:
    """The family's random model as safetensors (bfloat16) and as a Q8_0 GGUF file."""
    import transformers

    config_name, model_name, fields, arch = FAMILIES[family]
    path = root / family
    config = getattr(transformers, config_name)(**fields())
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = getattr(transformers, model_name)(config).to(torch.bfloat16)
    with torch.no_grad():  # routers that route (Qwen3-MoE's start at zero)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    del model
    build_byte_level_tokenizer(VOCAB).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path, write_qwen_gguf(path, arch, root / f"{family}.gguf", GGMLQuantizationType.Q8_0)


def transformers_tok_s(path: Path, batch: int, new_tokens: int, prompt_tokens: int) -> float:
    """Decode tokens/s of ``generate`` at ``batch`` rows: (batch x new_tokens) over the time of
    generating new_tokens + 1 tokens minus that of generating 1 (the prefill)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.randint(3, VOCAB - 100, (batch, prompt_tokens), generator=torch.Generator().manual_seed(1))

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                           min_new_tokens=n, pad_token_id=0)
        return time.perf_counter() - start

    timed(2)  # warm-up
    return batch * new_tokens / max(1e-9, timed(new_tokens + 1) - timed(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    p.add_argument("--no-transformers", action="store_true", help="skip transformers (its batch-16 runs are slow)")
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    root = Path(tempfile.mkdtemp(prefix="sluice-bench-families-"))
    rows: list[str] = []
    for family in args.families:
        started = time.perf_counter()
        hf_path, gguf = build(family, root)
        print(f"{family}: built in {time.perf_counter() - started:.0f} s ({gguf.stat().st_size / 2**20:.0f} MiB of "
              f"GGUF)", file=sys.stderr, flush=True)

        def sluice() -> Server:
            port = _free_port()
            return Server("sluice", [sys.executable, "-m", "frontend", "serve", "--model", str(gguf), "--port",
                                     str(port)], f"http://127.0.0.1:{port}")

        def llama_cpp(c: int) -> Server:
            port = _free_port()
            per_slot = max(512, args.prompt_tokens + args.output_tokens + 16)
            return Server("llama.cpp", [str(args.llama_server), "-m", str(gguf), "--port", str(port), "-t", str(cores),
                                        "-np", str(c), "-c", str(c * per_slot), "--no-webui"],
                          f"http://127.0.0.1:{port}", ready_path="/health")

        cells: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds):
            for c in args.concurrency:
                makers = {"sluice": lambda _c: sluice()}
                if args.llama_server:
                    makers["llama.cpp"] = llama_cpp
                for name, make in makers.items():
                    server = make(c)
                    try:
                        server.start()
                        asyncio.run(_cell(server.url, 1, 8, 4, 99))  # warm-up
                        cell = asyncio.run(_cell(server.url, c, args.prompt_tokens, args.output_tokens, 7 + r))
                        cells.setdefault((name, c), []).append(cell.tok_s)
                        print(f"  round {r + 1}, {name}, {c} streams: {cell.tok_s:,.1f} tok/s", file=sys.stderr,
                              flush=True)
                    except SystemExit as e:  # a server that refused the file: said, and the run goes on
                        print(f"  {name} failed: {e}", file=sys.stderr, flush=True)
                    finally:
                        server.stop()
        for c in args.concurrency:
            ours = statistics.median(cells[("sluice", c)]) if ("sluice", c) in cells else float("nan")
            theirs = statistics.median(cells[("llama.cpp", c)]) if ("llama.cpp", c) in cells else float("nan")
            hf = float("nan") if args.no_transformers else transformers_tok_s(hf_path, c, args.output_tokens,
                                                                              args.prompt_tokens)
            rows.append(f"| {family} | {c} | {ours:,.1f} | {theirs:,.1f} | {ours / theirs:.2f} | {hf:,.1f} | "
                        f"{ours / hf:.2f} |")
            print(rows[-1], file=sys.stderr, flush=True)
    print(f"\nRandom models at released shapes, Q8_0 GGUF (vocabulary {VOCAB:,}), {cores} cores, "
          f"{args.prompt_tokens} prompt + {args.output_tokens} output tokens a stream, median of {args.rounds} round(s)")
    print("| family | streams | Sluice tok/s | llama.cpp tok/s | ratio | transformers (bf16) decode tok/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
