"""The worker process: load the model, size the KV cache, announce readiness, run plans.

Sockets (connecting to the scheduler, which binds): PULL for commands, PUSH for results, and a
second PUSH owned by the heartbeat thread (ZeroMQ sockets are not thread-safe).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
from types import FrameType
from typing import Any

import torch
import zmq

from protocol.config import WorkerConfig
from protocol.messages import (
    ModelInfo,
    Shutdown,
    StepPlan,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerReady,
)
from protocol.transport import Endpoints, make_socket, scheduler_worker_codec, worker_codec
from worker.attention import KVCache
from worker.loader import load_model, read_tokenizer_files, resolve_device, resolve_dtype, resolve_model_dir
from worker.model_config import LlamaConfig
from worker.runner import ModelRunner

HEARTBEAT_S = 0.5
CPU_DEFAULT_KV_BYTES = 2 << 30
log = logging.getLogger("sluice.worker")

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"--kv-cache-memory: cannot read {text!r}; use bytes or e.g. 512MiB, 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def kv_cache_budget(config: WorkerConfig, device: torch.device) -> int:
    """Bytes for the KV cache: the flag, or on CUDA 90% of what is free after loading, or on the
    CPU 2 GiB capped at a quarter of physical memory."""
    if config.kv_cache_memory != "auto":
        return parse_bytes(config.kv_cache_memory)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(CPU_DEFAULT_KV_BYTES, total // 4)


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        model_dir = resolve_model_dir(config.model)
        cfg = LlamaConfig.from_file(model_dir / "config.json")
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        dtype = resolve_dtype(config.dtype, self.device, cfg)
        model = load_model(model_dir, cfg, dtype, self.device, max_positions=self.max_model_len)
        tokenizer = read_tokenizer_files(model_dir, cfg)
        per_block = KVCache.bytes_per_block(cfg.num_layers, config.block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
        num_blocks = config.num_kv_blocks or max(1, kv_cache_budget(config, self.device) // per_block)
        cache = KVCache.allocate(cfg.num_layers, num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim,
                                 dtype, self.device)
        log.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB on %s (%s)", num_blocks, config.block_size,
                 num_blocks * config.block_size, num_blocks * per_block / 2**20, self.device, dtype)
        self.runner = ModelRunner(model, cache, self.device, self.max_model_len, tokenizer["eos_token_ids"],
                                  config.max_num_seqs)
        name = config.served_model_name or config.model
        self.info = ModelInfo(
            name=name,
            max_model_len=self.max_model_len,
            vocab_size=cfg.vocab_size,
            eos_token_ids=tokenizer["eos_token_ids"],
            bos_token_id=tokenizer["bos_token_id"],
            tokenizer_json=tokenizer["tokenizer_json"],
            chat_template=tokenizer["chat_template"],
            add_bos_token=tokenizer["add_bos_token"],
            num_kv_blocks=num_blocks,
            block_size=config.block_size,
        )
        self._warm_up()

    def _warm_up(self) -> None:
        """One small forward so the first request does not pay for lazy initialisation. It writes
        into block 0, which no request has yet; requests always write before they read."""
        from protocol.messages import NewRequest, SamplingParams

        n = min(self.config.block_size, self.max_model_len - 1)
        plan = StepPlan(-1, [NewRequest(-1, list(range(n)), n, SamplingParams(max_tokens=1, temperature=0.0))],
                        [-1], [n], [[0]])
        for _ in self.runner.execute(plan):
            pass
        self.runner.seqs.clear()


def _heartbeat(ctx: zmq.Context[Any], address: str, rank: int, stop: threading.Event) -> None:
    sock = make_socket(ctx, zmq.PUSH, address, bind=False)
    encoded = scheduler_worker_codec().encode(WorkerHeartbeat(rank))
    try:
        while not stop.wait(HEARTBEAT_S):
            sock.send(encoded)
    finally:
        sock.close(linger=0)


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def run(config: WorkerConfig) -> int:
    signal.signal(signal.SIGTERM, _raise_exit)
    signal.signal(signal.SIGINT, _raise_exit)
    endpoints = Endpoints.from_base(config.address)
    ctx: zmq.Context[Any] = zmq.Context()
    out = make_socket(ctx, zmq.PUSH, endpoints.worker_to_scheduler, bind=False)
    inbox = make_socket(ctx, zmq.PULL, endpoints.scheduler_to_worker, bind=False)
    send_codec = scheduler_worker_codec()
    recv_codec = worker_codec()
    stop = threading.Event()
    try:
        try:
            worker = Worker(config)
        except Exception as e:
            log.exception("worker %d failed to start", config.rank)
            out.send(send_codec.encode(WorkerFailed(config.rank, f"{type(e).__name__}: {e}")))
            return 1
        threading.Thread(target=_heartbeat, args=(ctx, endpoints.worker_to_scheduler, config.rank, stop),
                         daemon=True, name="heartbeat").start()
        out.send(send_codec.encode(WorkerReady(config.rank, worker.info)))
        log.info("worker %d ready: %s, max model len %d", config.rank, worker.info.name, worker.max_model_len)
        while True:
            cmd = recv_codec.decode(inbox.recv(copy=False).buffer)
            if isinstance(cmd, StepPlan):
                try:
                    for step in worker.runner.execute(cmd):
                        out.send(send_codec.encode(step))
                except Exception as e:
                    log.exception("plan %d failed", cmd.plan_id)
                    out.send(send_codec.encode(WorkerFailed(config.rank, f"{type(e).__name__}: {e}")))
                    return 1
            elif isinstance(cmd, Shutdown):
                return 0
    finally:
        # Already stopping: a signal arriving during interpreter shutdown must not raise there.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop.set()
        out.close(linger=0)
        inbox.close(linger=0)
        ctx.term()
