"""Sampler, tiny model, loading errors, and the worker as a real process on real sockets."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zmq
from tokenizers import Tokenizer

from protocol.config import WorkerConfig, to_json
from protocol.messages import NewRequest, SamplingParams, Shutdown, StepPlan, StepTokens, WorkerReady
from protocol.transport import Endpoints, make_socket, scheduler_worker_codec, worker_codec
from worker.model_config import ModelLoadError
from worker.process import Worker
from worker.sampler import SamplingRow, sample
from worker.tiny import materialize_tiny


def rows(*params: SamplingParams, outputs: int = 0) -> list[SamplingRow]:
    return [SamplingRow(p, outputs, (2,)) for p in params]


def test_greedy_and_top_k_1_are_argmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    greedy = sample(logits.clone(), rows(*[SamplingParams(temperature=0.0)] * 4))
    top1 = sample(logits.clone(), rows(*[SamplingParams(temperature=0.7, top_k=1)] * 4))
    assert greedy.tolist() == logits.argmax(-1).tolist() == top1.tolist()


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.tensor([[5.0, 4.9, -5.0, -5.0, -6.0]] * 200)
    out = sample(logits, rows(*[SamplingParams(temperature=1.0, top_p=0.9)] * 200))
    assert set(out.tolist()) <= {0, 1} and len(set(out.tolist())) == 2


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 100, generator=gen)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = sample(logits[2:3].clone(), rows(seeded, outputs=5))
    others = [SamplingParams(temperature=1.0)] * 2 + [seeded] + [SamplingParams(temperature=0.5, top_p=0.5)] * 3
    batched = sample(logits.clone(), rows(*others, outputs=5))
    assert batched[2].item() == alone.item()
    # A different output index gives an independent draw for the same seed.
    draws = {sample(logits[2:3].clone(), rows(seeded, outputs=i)).item() for i in range(30)}
    assert len(draws) > 1


def test_min_tokens_bans_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 2] = 10.0  # EOS would win
    logits[0, 7] = 9.0  # then the stop id
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7])
    assert sample(logits.clone(), rows(params, outputs=1)).item() not in (2, 7)
    assert sample(logits.clone(), rows(params, outputs=3)).item() == 2


def test_tiny_model_is_a_real_small_llama(tmp_path: Path) -> None:
    a = materialize_tiny(tmp_path)
    assert materialize_tiny(tmp_path) == a  # reused, not rewritten
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"] and cfg["max_position_embeddings"] >= 8192
    tok = Tokenizer.from_file(str(a / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg["vocab_size"]
    text = "Héllo, 日本語 🦊!"
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    w = Worker(WorkerConfig(model=str(a), num_kv_blocks=16))
    n_params = sum(p.numel() for p in w.runner.model.parameters())
    assert 1_000_000 < n_params < 10_000_000


def _copy_tiny(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(materialize_tiny(tmp_path / "cache"), d)
    return d


def test_unknown_architecture_fails_clearly(tmp_path: Path) -> None:
    d = _copy_tiny(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported architecture"):
        Worker(WorkerConfig(model=str(d), num_kv_blocks=4))


def test_missing_weights_fail_clearly(tmp_path: Path) -> None:
    d = _copy_tiny(tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        Worker(WorkerConfig(model=str(d), num_kv_blocks=4))


def test_wrong_shape_fails_clearly(tmp_path: Path) -> None:
    d = _copy_tiny(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 512
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor .*mlp.* has shape"):
        Worker(WorkerConfig(model=str(d), num_kv_blocks=4))


def test_worker_process_over_real_sockets(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/engine"
    ep = Endpoints.from_base(address)
    ctx: zmq.Context = zmq.Context()
    inbox = make_socket(ctx, zmq.PULL, ep.worker_to_scheduler, bind=True)
    outbox = make_socket(ctx, zmq.PUSH, ep.scheduler_to_worker, bind=True)
    config = WorkerConfig(address=address, model=str(materialize_tiny(tmp_path)), num_kv_blocks=16)
    proc = subprocess.Popen([sys.executable, "-m", "worker", "--config", to_json(config)])
    decode, encode = scheduler_worker_codec(), worker_codec()
    try:
        assert inbox.poll(120_000), "worker never spoke"
        ready = decode.decode(inbox.recv())
        assert isinstance(ready, WorkerReady) and ready.model.num_kv_blocks == 16
        prompt = [1, 40, 41, 42, 43]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outbox.send(encode.encode(StepPlan(1, [NewRequest(7, prompt, 5, params)], [7], [5], [[0]], num_steps=6)))
        tokens: list[int] = []
        while True:
            assert inbox.poll(60_000)
            msg = decode.decode(inbox.recv())
            if isinstance(msg, StepTokens):
                tokens += msg.token_ids
                if msg.last:
                    break
        outbox.send(encode.encode(Shutdown()))
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        inbox.close(0)
        outbox.close(0)
        ctx.term()
    local = Worker(config)
    plan = StepPlan(1, [NewRequest(7, prompt, 5, params)], [7], [5], [[0]], num_steps=6)
    expected = [t for out in local.runner.execute(plan) for t in out.token_ids]
    assert tokens == expected and len(tokens) == 6
