"""One typed, validated config per component.

Building a config needs no files, so tests construct them directly. ``sluice`` builds them from
its flags and hands each child process its config as JSON on the command line
(``python -m scheduler --config '{...}'``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import msgspec

from protocol.curve import is_loopback

SCHEDULING_POLICIES = ("fcfs", "priority", "fair")
PREEMPTION_MODES = ("recompute", "swap")
# How chat answers are split into reasoning and content (frontend/reasoning.py): auto (when the
# tokenizer has <think> and </think>), none, or the <think> parser by its name or vLLM's names for it.
REASONING_PARSERS = ("auto", "none", "think", "qwen3", "deepseek_r1")

C = TypeVar("C")


class ConfigError(ValueError):
    """A flag or config value is invalid; the message names it and the allowed range."""


def _positive(name: str, value: int | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


SPECULATIVE_METHODS = ("none", "ngram", "draft")


def check_speculative(method: str, num_tokens: int) -> None:
    if method not in SPECULATIVE_METHODS:
        raise ConfigError(f"--speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
    _positive("--num-speculative-tokens", num_tokens)


def check_link_security(address: str, curve_keys: str | None, insecure_zmq: bool, *, binds: bool) -> None:
    """ZeroMQ off this machine needs CurveZMQ keys, or an explicit --insecure-zmq: a scheduler
    bound to a network address without them would take orders from anyone who can reach it."""
    if curve_keys is not None or insecure_zmq or is_loopback(address):
        return
    what = "bind" if binds else "connect to"
    raise ConfigError(f"will not {what} {address} without CurveZMQ keys: run `sluice keys DIR` and pass "
                      "--curve-keys DIR (env SLUICE_CURVE_KEYS) to every component, or --insecure-zmq on a "
                      "network you trust")


@dataclasses.dataclass
class SchedulerConfig:
    address: str = "ipc:///tmp/sluice"  # base address; see protocol.transport.Endpoints
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_threshold: int = 0  # 0 = off
    min_concurrent_prefills: int = 1
    num_scheduler_steps: int = 8
    async_scheduling: bool = True  # plan the next decode window while the worker runs this one
    scheduling_policy: str = "priority"
    priority_preemption: bool = True
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    num_host_blocks: int = 0  # swap space, in blocks; 0 = same count as the device cache
    # Seat caps per priority class: {P: N} = requests with priority >= P hold at most N seats.
    max_num_seqs_per_priority: dict[int, int] = dataclasses.field(default_factory=dict)
    # Worker losses survived (live requests recomputed on the restarted worker); past this many,
    # requests end with an error. ``sluice serve`` restarts its worker as often.
    max_worker_restarts: int = 3
    # How long live requests wait for a lost worker to come back before they end with an error.
    worker_restart_wait: float = 60.0
    tensor_parallel_size: int = 1
    curve_keys: str | None = None  # a `sluice keys` directory: CurveZMQ on the links
    insecure_zmq: bool = False  # allow plain ZeroMQ on a non-loopback address
    log_level: str = "info"
    speculative: str = "none"  # none | ngram: speculative decoding (the worker proposes and verifies)
    num_speculative_tokens: int = 6  # most proposed tokens a row verifies per step: blocks reserved for them
    speculative_max_batch: int = 8  # plans of more rows than this do not draft (verifying costs compute)

    def __post_init__(self) -> None:
        check_link_security(self.address, self.curve_keys, self.insecure_zmq, binds=True)
        _positive("--max-num-seqs", self.max_num_seqs)
        # JSON (the config's way to a child process) has string keys only.
        self.max_num_seqs_per_priority = {int(p): n for p, n in self.max_num_seqs_per_priority.items()}
        for p, n in self.max_num_seqs_per_priority.items():
            if not isinstance(n, int) or n < 1:
                raise ConfigError(f"--max-num-seqs-per-priority: the seats for priority >= {p} must be a "
                                  f"positive integer, got {n!r}")
        _positive("--max-num-batched-tokens", self.max_num_batched_tokens)
        _positive("--min-concurrent-prefills", self.min_concurrent_prefills)
        if self.worker_restart_wait <= 0:
            raise ConfigError("--worker-restart-wait must be > 0 seconds")
        if self.max_worker_restarts < 0:
            raise ConfigError("--max-worker-restarts must be >= 0")
        _positive("--num-scheduler-steps", self.num_scheduler_steps)
        check_speculative(self.speculative, self.num_speculative_tokens)
        if self.speculative_max_batch < 0:
            raise ConfigError("--speculative-max-batch must be >= 0 (0: no plan drafts)")
        _positive("--tensor-parallel-size", self.tensor_parallel_size)
        if self.long_prefill_threshold < 0:
            raise ConfigError("--long-prefill-threshold must be >= 0 (0 turns it off)")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"--preemption-mode must be one of {', '.join(PREEMPTION_MODES)}")


    @staticmethod
    def parse_priority_caps(text: str) -> dict[int, int]:
        """``"5:32,10:4"`` -> ``{5: 32, 10: 4}`` (the ``--max-num-seqs-per-priority`` flag)."""
        caps: dict[int, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            p, sep, n = item.partition(":")
            try:
                priority, seats = int(p), int(n)
            except ValueError:
                seats = 0
            if not sep or seats < 1:
                raise ConfigError(f"--max-num-seqs-per-priority takes PRIORITY:SEATS pairs such as 5:32 "
                                  f"(requests with priority >= 5 hold at most 32 seats), got {item!r}")
            if priority in caps:
                raise ConfigError(f"--max-num-seqs-per-priority names priority {priority} twice")
            caps[priority] = seats
        return caps


@dataclasses.dataclass
class WorkerConfig:
    address: str = "ipc:///tmp/sluice"
    model: str = "smollm2"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | float32 | bfloat16
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory
    kv_cache_memory: str = "auto"  # bytes, or "2GiB"-style; auto: a share of free memory
    gpu_memory_utilization: float = 0.9  # CUDA, auto: the device's share for weights, activations and the cache
    max_model_len: int | None = None  # None: the model's
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    served_model_name: str | None = None
    worker_threads: int = 0  # CPU threads of the forward pass; 0: chosen from the cores and the model
    generation_config: str = "auto"  # auto: the model's sampling defaults apply; none: OpenAI's
    jump_forward: bool = True  # append a grammar's forced tokens without a forward pass each
    tensor_parallel_size: int = 1
    rank: int = 0  # this worker's tensor-parallel rank
    # Rank 0 hosts the group's rendezvous here (bound to this address only); the others connect.
    tp_master: str = "127.0.0.1:29500"
    tp_timeout: float = 60.0  # seconds every rank gets to reach the rendezvous
    insecure_tp: bool = False  # allow the rendezvous on a network address (no authentication there)
    curve_keys: str | None = None
    insecure_zmq: bool = False
    log_level: str = "info"
    speculative: str = "none"  # none | ngram | draft: speculative decoding (``worker/ngram.py``, ``draft_model.py``)
    speculative_model: str = ""  # --speculative draft: the draft model (a name or path, as --model)
    num_speculative_tokens: int = 6  # most proposed tokens a row verifies per step
    ngram_min: int = 1  # shortest suffix an n-gram proposal matches
    ngram_max: int = 4  # longest

    def __post_init__(self) -> None:
        check_link_security(self.address, self.curve_keys, self.insecure_zmq, binds=False)
        _positive("--block-size", self.block_size)
        _positive("--num-kv-blocks", self.num_kv_blocks, allow_none=True)
        _positive("--max-model-len", self.max_model_len, allow_none=True)
        _positive("--tensor-parallel-size", self.tensor_parallel_size)
        if self.worker_threads < 0:
            raise ConfigError("--worker-threads must be >= 0 (0: automatic)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization is a share of the device, in (0, 1], not "
                              f"{self.gpu_memory_utilization:g}")
        if not 0 <= self.rank < self.tensor_parallel_size:
            raise ConfigError(f"--tp-rank must be in 0..{self.tensor_parallel_size - 1} (--tensor-parallel-size "
                              f"{self.tensor_parallel_size}), got {self.rank}")
        if self.tp_timeout <= 0:
            raise ConfigError("--tp-timeout must be > 0 seconds")
        if self.tensor_parallel_size > 1 and not self.insecure_tp and not is_loopback(f"tcp://{self.tp_master}"):
            # torch.distributed's rendezvous and collectives have no keys: whoever reaches the
            # port first takes a rank, and then sees and feeds every step's activations.
            raise ConfigError(f"will not host or join the tensor-parallel rendezvous at {self.tp_master} off this "
                              "machine: torch.distributed's links carry no authentication, and anyone who reaches "
                              "it first can take a rank. Keep the ranks on a private network and pass "
                              "--insecure-tp (env SLUICE_INSECURE_TP=1) to say so")
        if self.generation_config not in ("auto", "none"):
            raise ConfigError("--generation-config must be auto or none")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError("--dtype must be auto, float32, bfloat16 or float16")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError("--kv-cache-dtype must be auto (the model's dtype), float32 or bfloat16")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError("--device must be auto, cpu, cuda or cuda:N")
        check_speculative(self.speculative, self.num_speculative_tokens)
        if (self.speculative == "draft") != bool(self.speculative_model):
            raise ConfigError("--speculative draft and --speculative-model go together: the draft model proposes")
        if self.speculative == "draft" and self.tensor_parallel_size > 1:
            raise ConfigError("--speculative-model with --tensor-parallel-size > 1 is not served yet: use "
                              "--speculative ngram, or one rank")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"--ngram-min and --ngram-max must satisfy 1 <= min <= max, got {self.ngram_min} "
                              f"and {self.ngram_max}")


@dataclasses.dataclass
class FrontendConfig:
    # The scheduler's base address; several, comma-separated: one engine each (data parallelism).
    address: str = "ipc:///tmp/sluice"
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    admin_token: str | None = None
    max_queued_requests: int = 4096
    shutdown_grace: float = 3.0  # seconds in-flight requests get to finish on SIGTERM
    max_request_body: int = 16 * 2**20  # bytes; larger bodies get 413
    client_stall_timeout: float = 30.0  # a stream whose client reads nothing this long is dropped
    sse_keepalive: float = 15.0  # seconds of silence before a stream gets a heartbeat; 0 = never
    request_timeout: float = 0.0  # seconds from arrival before a request is aborted; 0 = none
    curve_keys: str | None = None
    insecure_zmq: bool = False
    log_level: str = "info"
    # Stored responses of the Responses API: none, sqlite (the default file) or sqlite:PATH.
    responses_store: str = "sqlite"
    # /v1/embeddings: the prompt's final hidden states pooled as its last token's, or their mean.
    pooling: str = "last"
    # Chat answers' <think> block as reasoning_content: auto, none, or on (think and its aliases).
    reasoning_parser: str = "auto"

    def __post_init__(self) -> None:
        if not (self.responses_store in ("none", "sqlite") or
                (self.responses_store.startswith("sqlite:") and len(self.responses_store) > len("sqlite:"))):
            raise ConfigError(f"--responses-store must be none, sqlite or sqlite:PATH, got {self.responses_store!r}")
        if self.pooling not in ("last", "mean"):
            raise ConfigError(f"--pooling must be last or mean, got {self.pooling!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                              f"got {self.reasoning_parser!r}")
        for address in self.addresses:
            check_link_security(address, self.curve_keys, self.insecure_zmq, binds=False)
        if len(set(self.addresses)) != len(self.addresses):
            raise ConfigError(f"--address names an engine twice: {self.address}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        _positive("--max-queued-requests", self.max_queued_requests)
        _positive("--max-request-body", self.max_request_body)
        if self.request_timeout < 0:
            raise ConfigError("--request-timeout must be >= 0 seconds (0 = none)")
        if self.client_stall_timeout <= 0:
            raise ConfigError("--client-stall-timeout must be > 0 seconds")
        if self.sse_keepalive < 0:
            raise ConfigError("--sse-keepalive must be >= 0 seconds (0 = no heartbeats)")
        if self.shutdown_grace < 0:
            raise ConfigError("--shutdown-grace must be >= 0 seconds")


    @property
    def addresses(self) -> list[str]:
        """Each engine's scheduler address."""
        return [a.strip() for a in self.address.split(",") if a.strip()] or [self.address]


def to_json(config: object) -> str:
    return msgspec.json.encode(config).decode()


def from_json(cls: type[C], text: str) -> C:
    """Decode and validate (``__post_init__`` runs, raising ``ConfigError`` on bad values)."""
    raw: dict[str, Any] = msgspec.json.decode(text)
    return cls(**raw)
