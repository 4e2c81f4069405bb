"""Every wire message survives its link's codec, and the address scheme is what the docs say."""

from __future__ import annotations

import msgspec
import pytest

from protocol import messages as m
from protocol.config import ConfigError, SchedulerConfig, WorkerConfig, from_json, to_json
from protocol.stop import length_reached, stop_reason
from protocol.transport import (
    Endpoints,
    frontend_codec,
    scheduler_frontend_codec,
    scheduler_worker_codec,
    worker_codec,
)

INFO = m.ModelInfo("tiny", 8192, 512, [2], 1, "{}", None, True, 100, 16)
SAMPLING = m.SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=[7], seed=3)

LINKS = [
    (scheduler_frontend_codec, [
        m.AddRequest(1, "cmpl-1", [1, 2, 3], SAMPLING, priority=-1, user="u", arrival_time=1.5),
        m.AbortRequest(1), m.SetPriority(1, 3, cut_in=True), m.PauseRequest(1), m.ResumeRequest(1),
        m.PauseAll(), m.ResumeAll(), m.ResetPrefixCache(), m.StatsQuery(3), m.RequestsQuery(4),
        m.RequestQuery(1, 5), m.Ping(2.0, True),
    ]),
    (frontend_codec, [
        m.TokenBatch([1, 2], [5, 6], [m.Finish(1, "stop", 3, 0, 1)]),
        m.EngineReady(INFO), m.Pong(1.0, True, False), m.QueryReply(4, True, {"a": 1}),
        m.QueryReply(5, True, [{"b": 2}]), m.EngineError("worker 0 died"),
    ]),
    (worker_codec, [
        m.StepPlan(7, [m.NewRequest(1, [1, 2], 2, SAMPLING, num_computed=1)], [1], [2], [[0]], num_steps=8, forget=[3]),
        m.StepPlan(8, [], [], [], [], swap_out=[(1, 2)], swap_in=[(3, 4)], copy_blocks=[(5, 6)]), m.Shutdown(),
    ]),
    (scheduler_worker_codec, [
        m.StepTokens(7, 0, [1], [9], False, 0.01), m.WorkerReady(0, INFO), m.WorkerHeartbeat(0),
        m.WorkerFailed(0, "out of memory"),
    ]),
]


@pytest.mark.parametrize(("codec_factory", "msgs"), LINKS)
def test_messages_round_trip(codec_factory, msgs) -> None:
    codec = codec_factory()
    for msg in msgs:
        assert codec.decode(codec.encode(msg)) == msg


def test_endpoints_from_tcp_and_ipc_bases() -> None:
    tcp = Endpoints.from_base("tcp://scheduler:5555")
    assert tcp.frontend_to_scheduler == "tcp://scheduler:5555"
    assert tcp.scheduler_to_worker == "tcp://scheduler:5558"
    assert Endpoints.from_base("ipc:///tmp/x/engine").worker_to_scheduler == "ipc:///tmp/x/engine-2"
    with pytest.raises(ValueError, match="tcp://host:port"):
        Endpoints.from_base("tcp://nohost")
    with pytest.raises(ValueError, match="must start with"):
        Endpoints.from_base("http://x:1")


def test_configs_validate_and_round_trip_json() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=512, min_concurrent_prefills=2)
    assert from_json(SchedulerConfig, to_json(cfg)) == cfg
    with pytest.raises(ConfigError, match="--scheduling-policy"):
        SchedulerConfig(scheduling_policy="random")
    with pytest.raises(ConfigError, match="--max-num-seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ConfigError, match="--dtype"):
        WorkerConfig(dtype="int3")


def test_stop_rule_each_case_and_min_tokens_with_ignore_eos() -> None:
    """(token, outputs, tokens) with EOS 2, stop id 9, max_tokens 5, max_model_len 20."""
    def reason(token: int, n_out: int, n_tok: int | None = None, *, min_tokens: int = 0,
               ignore_eos: bool = False) -> str | None:
        p = m.SamplingParams(max_tokens=5, stop_token_ids=[9], min_tokens=min_tokens, ignore_eos=ignore_eos)
        return stop_reason(token, n_out, n_tok if n_tok is not None else 10 + n_out, p, (2,), 20)

    STOP, LENGTH = m.FinishReason.STOP, m.FinishReason.LENGTH
    assert reason(7, 1) is None
    assert reason(9, 1) == STOP and reason(9, 1, min_tokens=3, ignore_eos=True) == STOP  # stop ids ignore both
    assert reason(2, 1) == STOP and reason(2, 1, ignore_eos=True) is None
    assert reason(2, 2, min_tokens=3) is None and reason(2, 3, min_tokens=3) == STOP  # EOS counts once min_tokens
    assert reason(2, 3, min_tokens=3, ignore_eos=True) is None
    assert reason(2, 5, ignore_eos=True) == LENGTH and reason(2, 5, min_tokens=6) == LENGTH  # length still ends it
    assert reason(7, 5) == LENGTH and reason(7, 4) is None
    assert reason(7, 2, 20) == LENGTH and reason(7, 2, 19) is None  # max_model_len
    assert reason(2, 5) == STOP and reason(9, 5) == STOP  # a stop beats length when both hold
    assert stop_reason(2, 1, 11, m.SamplingParams(), frozenset({2, 3}), 20) == STOP  # any EOS collection
    p = m.SamplingParams(max_tokens=5)
    assert not length_reached(4, 19, p, 20) and length_reached(5, 6, p, 20) and length_reached(1, 20, p, 20)


# The wire format pinned: array_like structs are encoded by field position, so a field moved
# (instead of appended) would still round-trip in one process yet break every peer running the
# other order. These bytes were taken from the format as released; a change here is a protocol
# change, for every component at once.
_S = m.SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=[7], seed=3)
# (SamplingParams' last fields, ``grammar``, ``prompt_logprobs`` and ``pooling``, were appended:
# nil here; so were AddRequest's ``output_token_ids`` (an empty array) and the ``prompt_logprobs``
# and ``embeddings`` of TokenBatch and StepTokens (nil), StepPlan's ``num_draft_tokens`` (0) and
# StepTokens' ``drafted`` and ``accepted`` (empty arrays) and ``jumped`` (0). A message without an appended field
# still decodes.)
_SAMPLING_HEX = ("dc001105cb0000000000000000cb3ff00000000000000000039107c2c0cb0000000000000000cb3ff0000000000000"
                 "cb0000000000000000cb000000000000000090c0c0c0")
FIXED_BYTES = [
    (m.AddRequest(1, "cmpl-1", [1, 2, 3], _S, priority=-1, user="u", arrival_time=1.5, n=2),
     "9aaa4164645265717565737401a6636d706c2d3193010203" + _SAMPLING_HEX + "ffa175cb3ff80000000000000290"),
    (m.TokenBatch([1, 2], [5, 6], [m.Finish(1, "stop", 3, 0, 1)], m.pack_logprobs([(2, (-0.5, [6], [-0.5]))]),
                  [(2, 16)], 7),
     "99aa546f6b656e4261746368920102920506919801a473746f70030001a0cb00000000000000000091920293cbbfe000000000"
     "0000910691cbbfe00000000000009192021007c0c0"),
    (m.StepPlan(7, [m.NewRequest(1, [1, 2], 2, _S, num_computed=1)], [1], [2], [[0]], num_steps=8, forget=[3]),
     "9da853746570506c616e0791950192010202" + _SAMPLING_HEX + "0191019102919100089103909090c200"),
    (m.StepTokens(7, 0, [1], [9], False, 0.25),
     "9daa53746570546f6b656e73070091019109c2cb3fd0000000000000c0c0c0909000"),
    (m.Pong(1.0, True, False, None, 9, "", 4), "98a4506f6e67cb3ff0000000000000c3c2c009a004"),
]


@pytest.mark.parametrize(("msg", "wire"), FIXED_BYTES, ids=[type(msg).__name__ for msg, _ in FIXED_BYTES])
def test_the_wire_format_is_pinned(msg: object, wire: str) -> None:
    assert msgspec.msgpack.encode(msg).hex() == wire


def test_a_reordered_field_fails_the_pinned_bytes() -> None:
    """What the test above guards against: the same fields in another order encode differently."""

    class Reordered(msgspec.Struct, tag="StepTokens", array_like=True):
        plan_id: int
        step: int
        token_ids: list[int]  # swapped with rids
        rids: list[int]
        last: bool
        busy_s: float = 0.0
        logprobs: msgspec.Raw = m.NO_LOGPROBS

    wire = dict((type(msg).__name__, hexed) for msg, hexed in FIXED_BYTES)["StepTokens"]
    same_message = Reordered(plan_id=7, step=0, token_ids=[9], rids=[1], last=False, busy_s=0.25)
    assert msgspec.msgpack.encode(same_message).hex() != wire
