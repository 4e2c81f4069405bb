"""The output processor alone (no sockets): a client that keeps up gets one chunk per token; one
that lags gets what piled up in one write, its text merged past ``COALESCE_AFTER`` chunks (never
with logprobs); and whatever ends the response, nothing is written after ``[DONE]``."""

from __future__ import annotations

import asyncio
import json

from fake_scheduler import model_info

from frontend.output import COALESCE_AFTER, Output, OutputProcessor
from frontend.render import CompletionRenderer
from frontend.sse import KEEPALIVE, KEEPALIVE_S, StreamWatchdog
from frontend.tokenizer import ModelTokenizer
from protocol.messages import (
    AddRequest,
    Finish,
    SamplingParams,
    TokenBatch,
    pack_logprobs,
    pack_prompt_logprobs,
)

TOKENIZER = ModelTokenizer(model_info())
TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def make(logprobs: int | None = None, n: int = 1) -> tuple[OutputProcessor, Output, list[int]]:
    aborted: list[int] = []
    processor = OutputProcessor(aborted.append)
    request = AddRequest(10, "cmpl-x", [1, 5, 6], SamplingParams(max_tokens=4096, ignore_eos=True, logprobs=logprobs),
                         n=n)
    renderer = CompletionRenderer("cmpl-x", 0, "m", TOKENIZER, [1, 5, 6], False, logprobs)
    output = Output(request, TOKENIZER, [], renderer, streaming=True, include_usage=False)
    processor.add(output)
    return processor, output, aborted


def events(data: bytes) -> list[dict]:
    return [json.loads(e[len(b"data: "):]) for e in data.split(b"\n\n") if e.startswith(b"data: {")]


def batch(rid: int, token: int, last: bool, count: int, logprobs: bool = False) -> TokenBatch:
    finished = [Finish(rid, "length", 3, 0, count)] if last else []
    lp = pack_logprobs([(rid, (-1.0, [token], [-1.0]))]) if logprobs else pack_logprobs([])
    return TokenBatch([rid], [token], finished, lp)


def test_a_client_that_keeps_up_gets_a_chunk_per_token_and_one_that_lags_gets_the_rest_merged() -> None:
    ids = TOKENIZER.encode_text(TEXT)
    assert len(ids) > COALESCE_AFTER + 10

    async def steady() -> list[bytes]:
        processor, output, _ = make()
        writes = []
        for i, token in enumerate(ids):
            processor.process(batch(10, token, i == len(ids) - 1, i + 1))
            while output.buffer:
                data = await output.take()
                assert data is not None
                writes.append(data)
        assert await output.take() is None
        return writes

    async def lagging() -> list[bytes]:
        processor, output, _ = make()
        for i, token in enumerate(ids):
            processor.process(batch(10, token, i == len(ids) - 1, i + 1))
        writes = []
        while (data := await output.take()) is not None:
            writes.append(data)
        return writes

    steady_writes, lagging_writes = asyncio.run(steady()), asyncio.run(lagging())
    steady_events = [e for w in steady_writes for e in events(w)]
    assert all(len(events(w)) == 1 for w in steady_writes[:-1])  # the last write: the final chunk and [DONE]
    assert len(steady_events) == len(ids)
    assert len(lagging_writes) == 1, "what piled up goes out in one write"
    lagged = events(lagging_writes[0])
    assert len(lagged) == COALESCE_AFTER + 1  # a chunk per token, then the rest merged into the final one
    for evs in (steady_events, lagged):
        assert "".join(e["choices"][0]["text"] for e in evs) == TOKENIZER.decode(ids)
        assert evs[-1]["choices"][0]["finish_reason"] == "length"
    assert lagging_writes[0].endswith(b"data: [DONE]\n\n")


def test_logprobs_chunks_are_never_merged() -> None:
    ids = TOKENIZER.encode_text(TEXT)[: COALESCE_AFTER + 20]

    async def run() -> bytes:
        processor, output, _ = make(logprobs=1)
        for i, token in enumerate(ids):
            processor.process(batch(10, token, i == len(ids) - 1, i + 1, logprobs=True))
        return b"".join([data async for data in _drain(output)])

    evs = events(asyncio.run(run()))
    assert len(evs) == len(ids) and all(len(e["choices"][0]["logprobs"]["tokens"]) == 1 for e in evs)


def test_an_error_after_a_backlog_comes_after_the_merged_text_and_before_done() -> None:
    ids = TOKENIZER.encode_text(TEXT)[: COALESCE_AFTER + 20]

    async def run() -> bytes:
        processor, output, _ = make(n=2)
        for token in ids:
            processor.process(TokenBatch([10], [token]))  # choice 0 lags far behind
        processor.process(TokenBatch([], [], [Finish(11, "error", 3, 0, 0, "the worker died")]))
        return b"".join([data async for data in _drain(output)])

    data = asyncio.run(run())
    assert data.endswith(b"data: [DONE]\n\n") and data.count(b"data: [DONE]") == 1
    body = data[: -len(b"data: [DONE]\n\n")]
    assert body.rstrip().endswith(b"}}") and b"the worker died" in body.rsplit(b"data: ", 1)[1]
    texts = "".join(e["choices"][0]["text"] for e in events(body) if "choices" in e)
    assert texts == TOKENIZER.decode(ids)


async def _drain(output: Output):  # type: ignore[no-untyped-def]
    while (data := await output.take()) is not None:
        yield data


def test_the_watchdog_keeps_a_silent_stream_alive_and_drops_a_stalled_one() -> None:
    async def run() -> None:
        _, quiet, _ = make()
        _, stalled, _ = make()
        never = asyncio.get_running_loop().create_future()
        quiet.writer = asyncio.ensure_future(never)
        stalled.writer = asyncio.ensure_future(asyncio.sleep(60))
        watchdog = StreamWatchdog(lambda: [quiet, stalled], timeout=30, keepalive=KEEPALIVE_S)
        quiet.last_write = 100.0  # its last write, just under then just over KEEPALIVE_S before the checks
        stalled.write_started = 100.0  # a write blocked since then
        watchdog.check(100.0 + KEEPALIVE_S - 1)
        assert quiet.buffer == [] and not stalled.stalled
        watchdog.check(100.0 + KEEPALIVE_S + 1)
        assert quiet.buffer == [KEEPALIVE], "a heartbeat every KEEPALIVE_S of silence"
        watchdog.check(100.0 + KEEPALIVE_S + 2)
        assert quiet.buffer == [KEEPALIVE], "not again before another KEEPALIVE_S"
        watchdog.check(100.0 + 31)
        assert stalled.stalled and quiet.buffer == [KEEPALIVE]
        await asyncio.sleep(0)
        assert stalled.writer.cancelled()
        quiet.writer.cancel()

    asyncio.run(run())


def test_no_heartbeat_when_they_are_off() -> None:
    _, quiet, _ = make()
    quiet.writer = object()  # type: ignore[assignment]  # a stream being written
    quiet.last_write = 100.0
    StreamWatchdog(lambda: [quiet], timeout=30, keepalive=0).check(100.0 + 1000)
    assert quiet.buffer == []


def test_echoed_prompt_scores_render_once_they_come_and_a_mis_sized_set_is_not_shown() -> None:
    """A prompt's scores arrive with its first token; a set that does not match the prompt
    (an engine bug) leaves the prompt unscored instead of failing the response."""
    for entries, shown in (([(-0.5, 1, [5], [-0.5]), (-0.25, 1, [6], [-0.25])], [None, -0.5, -0.25]),
                           ([(-0.5, 1, [5], [-0.5])], [None, None, None])):
        processor, output, _ = make(logprobs=1)
        output.renderer = CompletionRenderer("cmpl-x", 0, "m", TOKENIZER, [1, 5, 6], False, 1, echo=True)
        first = TokenBatch([10], [7], [Finish(10, "length", 3, 0, 1)], pack_logprobs([(10, (-1.0, [7], [-1.0]))]),
                           prompt_logprobs=pack_prompt_logprobs([(10, entries)]))
        processor.process(first)
        chunk = events(output.buffer[0])[0]["choices"][0]
        assert chunk["logprobs"]["token_logprobs"] == [*shown, -1.0]
        assert chunk["text"].endswith(TOKENIZER.decode([7]))


class RaisingRenderer(CompletionRenderer):
    """A renderer with a bug that only one request's text reaches: it raises on ``bad``."""

    def __init__(self, bad: str, *args: object) -> None:
        super().__init__(*args)
        self.bad = bad

    def token(self, choice, text):  # type: ignore[no-untyped-def]
        if self.bad in text:
            raise ValueError(f"cannot render {text!r}")
        return super().token(choice, text)


def test_a_choice_that_raises_ends_alone_and_the_rest_of_the_batch_goes_on() -> None:
    """Before the fault boundary the exception left ``process`` mid-batch: every row after the
    raising one lost its token, on every batch of that request's life."""
    ids = TOKENIZER.encode_text(" one two three four five six")
    bad_at = 2
    bad = TOKENIZER.decode(ids[bad_at : bad_at + 1]).strip()

    async def run() -> tuple[bytes, bytes, list[int]]:
        aborted: list[int] = []
        processor = OutputProcessor(aborted.append)
        outputs = []
        for rid, renderer in ((10, RaisingRenderer(bad, "cmpl-bad", 0, "m", TOKENIZER, [1], False, None)),
                              (20, CompletionRenderer("cmpl-ok", 0, "m", TOKENIZER, [1], False, None))):
            request = AddRequest(rid, f"cmpl-{rid}", [1], SamplingParams(max_tokens=100, ignore_eos=True))
            outputs.append(Output(request, TOKENIZER, [], renderer, streaming=True, include_usage=False))
            processor.add(outputs[-1])
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            finished = [Finish(20, "length", 1, 0, i + 1)] if last else []
            # The raising request comes first in every batch, the healthy one after it.
            processor.process(TokenBatch([10, 20], [token, token], finished, pack_logprobs([])))
        bad_out = b"".join(outputs[0].buffer)
        good_out = b"".join(outputs[1].buffer)
        return bad_out, good_out, aborted

    bad_out, good_out, aborted = asyncio.run(run())
    good = events(good_out)
    assert "".join(e["choices"][0]["text"] for e in good) == TOKENIZER.decode(ids)
    assert good[-1]["choices"][0]["finish_reason"] == "length" and good_out.endswith(b"data: [DONE]\n\n")
    bad_events = events(bad_out)
    assert len(bad_events) == bad_at + 1, "its text up to the fault, then the error"
    assert bad_events[-1]["error"]["code"] == "internal_error"
    assert bad_out.endswith(b"data: [DONE]\n\n")
    assert aborted == [10], "the faulted request is stopped in the scheduler (its blocks come back)"
