"""The worker's runner against ``transformers`` on the same checkpoints: greedy tokens alone,
batched, chunked (mixed with decodes), multi-step and after a recompute preemption; logits of a
chunk after a cached prefix; llama3 rope scaling; Qwen2 (q/k/v bias, tied embeddings) loaded
from shards; Mistral's sliding window."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import hf_greedy, save_llama_checkpoint
from worker_testing import Driver, greedy, one_cpu_thread

from protocol.config import WorkerConfig
from protocol.messages import NewRequest
from worker.attention import AttentionMetadata
from worker.engine import Worker
from worker.tiny import build_byte_level_tokenizer

NEW = 32
PROMPTS = {
    0: [1, *range(10, 14)],
    1: [1, *range(20, 36)],
    2: [1, *range(40, 79)],
    3: [1, *(t % 300 + 3 for t in range(69))],
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with one_cpu_thread():
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama_checkpoint(tmp_path_factory.mktemp("w") / "llama")


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> dict[int, list[int]]:
    return dict(zip(PROMPTS, hf_greedy(checkpoint, list(PROMPTS.values()), NEW), strict=True))


@pytest.fixture(scope="module")
def worker(checkpoint: Path) -> Worker:
    return Worker(WorkerConfig(model=str(checkpoint), num_kv_blocks=512, block_size=8))


@pytest.mark.parametrize("steps", [1, 8])
def test_each_prompt_alone_matches_transformers(worker: Worker, expected: dict[int, list[int]], steps: int) -> None:
    for rid, prompt in PROMPTS.items():
        d = Driver(worker.runner)
        d.prefill({rid: prompt}, greedy(NEW), steps)
        d.decode_to_end(steps)
        assert d.outputs[rid] == expected[rid], f"prompt {rid}"


@pytest.mark.parametrize("steps", [1, 8])
def test_batched_prompts_match_transformers(worker: Worker, expected: dict[int, list[int]], steps: int) -> None:
    d = Driver(worker.runner)
    d.prefill(PROMPTS, greedy(NEW), steps)
    d.decode_to_end(steps)
    assert d.outputs == expected


@pytest.mark.parametrize("steps", [1, 3])
def test_chunked_prefills_mixed_with_decodes_match_transformers(worker: Worker, expected: dict[int, list[int]],
                                                                 steps: int) -> None:
    """Prompt k starts at plan k and advances 7 tokens per plan, in the same forward passes
    as the decodes of the prompts that started before it."""
    d = Driver(worker.runner)
    chunk, started = 7, 0
    while started < len(PROMPTS) or d.live():
        new, rows = [], []
        for rid in d.live():
            seq = worker.runner.seqs[rid]
            rows.append((rid, min(chunk, len(seq.token_ids) - seq.num_computed)))
        if started < len(PROMPTS):
            prompt = PROMPTS[started]
            new.append(NewRequest(started, prompt, len(prompt), greedy(NEW)))
            rows.append((started, min(chunk, len(prompt))))
            started += 1
        d.plan(rows, new, steps)
    assert d.outputs == expected


def test_recompute_after_preemption_matches_transformers(worker: Worker, expected: dict[int, list[int]]) -> None:
    d = Driver(worker.runner)
    rid, prompt = 2, PROMPTS[2]
    d.prefill({rid: prompt}, greedy(NEW))
    for _ in range(9):
        d.plan([(rid, 1)])
    known = prompt + d.outputs[rid]  # everything so far; the worker's state is then dropped
    d.plan([(rid, len(known))], [NewRequest(rid, known, len(prompt), greedy(NEW))], forget=[rid])
    d.decode_to_end(4)
    assert d.outputs[rid] == expected[rid]


def test_logits_match_transformers_forward(worker: Worker, checkpoint: Path) -> None:
    """One forward pass holding a whole prompt and, for another, the chunk after a 30-token
    prefix computed by an earlier plan: every position's logits match."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    whole, chunked = PROMPTS[2], PROMPTS[3]
    with torch.no_grad():
        want_whole = hf(torch.tensor([whole])).logits[0]
        want_chunk = hf(torch.tensor([chunked])).logits[0, 30:]
    runner = worker.runner
    d = Driver(runner)
    d.plan([(5, 30)], [NewRequest(5, chunked, len(chunked), greedy(1))])  # the prefix: samples nothing
    assert d.outputs == {} and runner.seqs[5].num_computed == 30
    chunk_table = d.tables[5] + [next(d.free) for _ in range(5)]
    whole_table = [next(d.free) for _ in range(5)]
    n = len(chunked) - 30
    meta = AttentionMetadata.build(runner.cache, [whole_table, chunk_table], [0, 30], [len(whole), n],
                                   list(range(len(whole) + n)), runner.device)
    with torch.inference_mode():
        got = runner.model(torch.tensor(whole + chunked[30:]), meta)
    torch.testing.assert_close(got[: len(whole)], want_whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[len(whole) :], want_chunk, atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    ckpt = save_llama_checkpoint(tmp_path / "l3", seed=1, rope_scaling=scaling, max_position_embeddings=512)
    prompt = PROMPTS[3] * 2  # 138 tokens: well past the original 64 positions
    want = hf_greedy(ckpt, [prompt], 16)[0]
    d = Driver(Worker(WorkerConfig(model=str(ckpt), num_kv_blocks=64, block_size=8)).runner)
    d.prefill({0: prompt}, greedy(16), 16)
    assert d.outputs[0] == want


def _save_hf(path: Path, config: Any, model_cls: Any, tokenizer_config: dict[str, Any], **save: Any) -> Path:
    torch.manual_seed(3)
    model_cls(config).eval().save_pretrained(path, **save)
    build_byte_level_tokenizer(config.vocab_size).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


SMALL: dict[str, Any] = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
             initializer_range=0.1)


def test_qwen2_bias_and_tied_embeddings_from_shards_match_transformers(tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SMALL, rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
                         tie_word_embeddings=True)
    ckpt = _save_hf(tmp_path / "qwen2", config, Qwen2ForCausalLM, {"bos_token": None, "eos_token": "</s>"},
                    max_shard_size="60KB")
    assert (ckpt / "model.safetensors.index.json").exists()
    prompts = [PROMPTS[1], PROMPTS[2]]
    want = hf_greedy(ckpt, prompts, 12)
    w = Worker(WorkerConfig(model=str(ckpt), num_kv_blocks=64, block_size=8))
    assert w.info.bos_token_id is None and not w.info.add_bos_token
    d = Driver(w.runner)
    d.prefill(dict(enumerate(prompts)), greedy(12), 4)
    d.decode_to_end(4)
    assert [d.outputs[0], d.outputs[1]] == want


def test_mistral_sliding_window_matches_transformers(tmp_path: Path) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**SMALL, sliding_window=16)
    ckpt = _save_hf(tmp_path / "mistral", config, MistralForCausalLM, {"bos_token": "<s>", "eos_token": "</s>"})
    prompt = PROMPTS[2]  # 39 tokens: most of the context lies outside the window
    want = hf_greedy(ckpt, [prompt], 12)[0]
    d = Driver(Worker(WorkerConfig(model=str(ckpt), num_kv_blocks=64, block_size=8)).runner)
    d.prefill({0: prompt}, greedy(12), 4)
    d.decode_to_end(4)
    assert d.outputs[0] == want
