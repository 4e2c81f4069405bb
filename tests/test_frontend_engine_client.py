"""The frontend's engine client over real ZeroMQ sockets, against a scheduler the test drives:
tokens reach their response, nothing is lost in silence (a gap in the batches' numbers, a
scheduler that stops answering, a socket task that dies), and a response's handle aborts what
still runs however the response ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fake_scheduler import FakeScheduler

from frontend import engine_client
from frontend.app import build_app
from frontend.engine_client import EngineClient
from frontend.metrics import Metrics
from frontend.output import Output
from frontend.render import CompletionRenderer
from frontend.tokenizer import ModelTokenizer
from protocol.config import FrontendConfig
from protocol.messages import AbortRequest, AddRequest, Finish, FinishReason, SamplingParams, TokenBatch


@contextlib.asynccontextmanager
async def connected(tmp_path: Path) -> AsyncIterator[tuple[EngineClient, FakeScheduler]]:
    address = f"ipc://{tmp_path}/engine"
    async with FakeScheduler(address) as scheduler:
        client = EngineClient(address)
        client.outputs.metrics = Metrics(lambda: None, lambda: "fake")
        await client.start()
        try:
            async with asyncio.timeout(10):
                await client.ready.wait()
                while scheduler.frontend is None:
                    await asyncio.sleep(0.01)
            yield client, scheduler
        finally:
            await client.close()


def output_for(client: EngineClient, text_ids: list[int], n: int = 1, stop: list[str] | None = None,
               streaming: bool = True) -> Output:
    assert client.model is not None
    tokenizer = ModelTokenizer(client.model)
    request = AddRequest(client.next_rids(n), "cmpl-test", text_ids, SamplingParams(max_tokens=64), n=n)
    renderer = CompletionRenderer("cmpl-test", 0, "fake", tokenizer, text_ids, False, None)
    return Output(request, tokenizer, stop or [], renderer, streaming, include_usage=True)


async def drain(output: Output) -> bytes:
    chunks = []
    while (data := await output.take()) is not None:
        chunks.append(data)
    return b"".join(chunks)


async def test_tokens_reach_their_stream_and_the_finish_ends_it(tmp_path: Path) -> None:
    async with connected(tmp_path) as (client, scheduler):
        assert client.model is not None
        tokenizer = ModelTokenizer(client.model)
        ids = tokenizer.encode_text("Hello world, and more")
        output = output_for(client, [1, 5, 6])
        handle = await client.add(output)
        (add,) = await scheduler.wait_for(AddRequest)
        rid = add.rid
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            await scheduler.send(TokenBatch([rid], [token], [Finish(rid, "length", 3, 2, len(ids))] if last else [],
                                            started=[(rid, 2)] if i == 0 else []))
        async with handle:
            body = await asyncio.wait_for(drain(output), 10)
        text = b"".join(line[len(b'data: {'):] for line in body.split(b"\n\n") if line.startswith(b"data: {"))
        assert body.endswith(b"data: [DONE]\n\n")
        assert body.count(b'"text":') == len(ids)
        assert b'"finish_reason":"length"' in body and b'"cached_tokens":2' in body
        assert b"".join(
            chunk.split(b'"text":"')[1].split(b'"')[0] for chunk in text.split(b"}]}") if b'"text":"' in chunk) == b"Hello world, and more"
        assert not [m for m in scheduler.received if isinstance(m, AbortRequest)], "a finished request is not aborted"
        assert client.num_live == 0 and len(client.outputs) == 0


async def test_a_batch_with_several_steps_of_a_request_ends_it_after_its_last_token(tmp_path: Path) -> None:
    """The scheduler merges the steps it receives at once: one batch may hold a request's
    tokens of several steps, its finish with the last of them."""
    async with connected(tmp_path) as (client, scheduler):
        assert client.model is not None
        ids = ModelTokenizer(client.model).encode_text("one two three")
        output = output_for(client, [1, 5, 6], streaming=False)
        handle = await client.add(output)
        (add,) = await scheduler.wait_for(AddRequest)
        rid = add.rid
        await scheduler.send(TokenBatch([rid] * len(ids), ids, [Finish(rid, "length", 3, 0, len(ids))]))
        async with handle:
            await asyncio.wait_for(output.done.wait(), 10)
        choice = output.body()["choices"][0]
        assert choice["text"] == "one two three" and choice["finish_reason"] == "length"
        assert output.body()["usage"]["completion_tokens"] == len(ids) > 1


async def test_leaving_the_handle_aborts_a_request_still_running(tmp_path: Path) -> None:
    async with connected(tmp_path) as (client, scheduler):
        output = output_for(client, [1, 5, 6], n=2)
        handle = await client.add(output)
        (add,) = await scheduler.wait_for(AddRequest)
        assert add.n == 2 and client.num_waiting_first_token == 2
        await scheduler.send(TokenBatch([add.rid + 1], [40], [Finish(add.rid + 1, "length", 3, 0, 1)]))
        async with asyncio.timeout(10):
            while 1 not in output.finishes:
                await asyncio.sleep(0.01)
        async with handle:
            pass  # the client went away (or the response raised) before anything was written
        async with handle:
            pass  # leaving twice changes nothing
        aborts = await scheduler.wait_for(AbortRequest)
        await asyncio.sleep(0.1)
        assert [m.rid for m in scheduler.received if isinstance(m, AbortRequest)] == [add.rid], \
            "the running choice is aborted once; the finished one is not"
        assert aborts and client.num_waiting_first_token == 0 and client.rid_by_id == {}


async def test_a_gap_in_the_batch_numbers_ends_every_live_stream_with_an_error_and_aborts_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with connected(tmp_path) as (client, scheduler):
        outputs = [output_for(client, [1, 5, 6]) for _ in range(2)]
        handles = [await client.add(o) for o in outputs]
        adds = await scheduler.wait_for(AddRequest, 2)
        await scheduler.send(TokenBatch([adds[0].rid, adds[1].rid], [40, 41]))
        scheduler.seq += 1  # this batch "was lost on the link"
        await scheduler.send(TokenBatch([adds[0].rid], [42]))
        bodies = [await asyncio.wait_for(drain(o), 10) for o in outputs]
        for body in bodies:
            assert b'"error"' in body and b"lost on the link" in body and body.endswith(b"data: [DONE]\n\n")
        aborted = {m.rid for m in await scheduler.wait_for(AbortRequest, 2)}
        assert aborted == {adds[0].rid, adds[1].rid}
        for handle in handles:
            async with handle:
                pass
        assert client.outputs.metrics is not None
        metrics = client.outputs.metrics.render().decode()
        assert "sluice_lost_output_batches_total 1.0" in metrics
        assert "sluice_streams_ended_by_lost_output_total 2.0" in metrics
        assert "was lost on the link" in caplog.text


async def test_a_lost_last_batch_is_found_by_the_next_pong(tmp_path: Path) -> None:
    """The batch lost was the stream's last (its finish): no later batch shows a gap, but the
    next pong says how many batches were sent, so the stream does not wait forever."""
    async with connected(tmp_path) as (client, scheduler):
        output = output_for(client, [1, 5, 6])
        handle = await client.add(output)
        (add,) = await scheduler.wait_for(AddRequest)
        await scheduler.send(TokenBatch([add.rid], [40]))
        scheduler.seq += 1  # the finish "was lost on the link"
        async with handle:
            body = await asyncio.wait_for(drain(output), 10)
        assert b"lost on the link" in body and body.endswith(b"data: [DONE]\n\n")


async def test_a_silent_scheduler_ends_streams_and_they_are_aborted(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_client, "SCHEDULER_TIMEOUT_S", 1.0)
    async with connected(tmp_path) as (client, scheduler):
        output = output_for(client, [1, 5, 6])
        handle = await client.add(output)
        (add,) = await scheduler.wait_for(AddRequest)
        scheduler.answer_pings = False
        async with handle:
            body = await asyncio.wait_for(drain(output), 10)
        assert b"stopped answering" in body
        (abort,) = await scheduler.wait_for(AbortRequest)
        assert abort.rid == add.rid, "a scheduler that is only slow must not compute it on for nobody"


async def test_a_receive_task_that_dies_is_reported_and_started_again(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    async with connected(tmp_path) as (client, scheduler):
        output = output_for(client, [1, 5, 6])
        handle = await client.add(output)
        (add,) = await scheduler.wait_for(AddRequest)
        real_recv = client._pull.recv
        calls = 0

        async def recv_once_broken(*args: object, **kwargs: object) -> object:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("injected socket failure")
            return await real_recv(*args, **kwargs)

        client._pull.recv = recv_once_broken
        await scheduler.send(TokenBatch([add.rid], [40]))  # wakes the receive task: it dies
        async with handle:
            body = await asyncio.wait_for(drain(output), 10)
        assert b"injected socket failure" in body
        assert "receive_loop task died" in caplog.text
        later = output_for(client, [1, 5, 6])
        later_handle = await client.add(later)
        (_, add2) = await scheduler.wait_for(AddRequest, 2)
        await scheduler.send(TokenBatch([add2.rid], [40], [Finish(add2.rid, "length", 3, 0, 1)]))
        async with later_handle:
            assert b'"finish_reason":"length"' in await asyncio.wait_for(drain(later), 10)


async def test_a_stop_string_ends_the_request_with_its_cached_tokens_counted(tmp_path: Path) -> None:
    async with connected(tmp_path) as (client, scheduler):
        assert client.model is not None
        tokenizer = ModelTokenizer(client.model)
        output = output_for(client, [1, 5, 6], stop=["world"], streaming=False)
        handle = await client.add(output)
        (add,) = await scheduler.wait_for(AddRequest)
        ids = tokenizer.encode_text("Hello world and more")
        await scheduler.send(TokenBatch([add.rid], [ids[0]], started=[(add.rid, 32)]))
        for token in ids[1:]:
            await scheduler.send(TokenBatch([add.rid], [token]))
        async with handle:
            await asyncio.wait_for(output.done.wait(), 10)
        body = output.body()
        assert body["choices"][0]["text"] == "Hello " and body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        (abort,) = await scheduler.wait_for(AbortRequest)
        assert abort.rid == add.rid


async def test_request_timeout_aborts_with_its_reason(tmp_path: Path) -> None:
    async with connected(tmp_path) as (client, scheduler):
        client.request_timeout = 0.3
        output = output_for(client, [1, 5, 6], streaming=False)
        handle = await client.add(output)
        (add,) = await scheduler.wait_for(AddRequest)
        started = time.monotonic()
        (abort,) = await scheduler.wait_for(AbortRequest)
        assert abort.rid == add.rid and time.monotonic() - started < 5
        await scheduler.send(TokenBatch([], [], [Finish(add.rid, FinishReason.ABORT, 3, 0, 0)]))
        async with handle:
            await asyncio.wait_for(output.done.wait(), 10)
        choice = output.body()["choices"][0]
        assert choice["finish_reason"] == "abort" and "--request-timeout" in choice["abort_reason"]


async def test_a_client_gone_before_the_first_chunk_has_its_request_aborted(tmp_path: Path) -> None:
    """Under an ASGI server whose ``send`` raises once the client has gone (rather than
    returning quietly, as uvicorn does), the response's first write fails: the request must be
    aborted all the same — not run on to ``max_tokens`` for nobody."""
    async with connected(tmp_path) as (client, scheduler):
        app = build_app(FrontendConfig(address=f"ipc://{tmp_path}/engine"), client)
        scope, receive = _asgi_post(app, {"prompt": "Hello", "max_tokens": 500, "stream": True})

        async def send(message: dict[str, object]) -> None:
            raise OSError("the client has gone")

        with pytest.raises(OSError):
            await app(scope, receive, send)
        (add,) = await scheduler.wait_for(AddRequest)
        (abort,) = await scheduler.wait_for(AbortRequest)
        assert abort.rid == add.rid and client.num_live == 0


async def test_a_stream_the_engine_refuses_at_once_gets_a_503(tmp_path: Path) -> None:
    """No worker (it is being restarted): the scheduler refuses a new request at once. A stream's
    headers wait a moment for its first output, so the client gets a 503 it can retry on, as a
    request that does not stream does — not a 200 and an error event."""
    async with connected(tmp_path) as (client, scheduler):
        scheduler.refuse_adds = "no worker: worker lost (test); retry when /ready answers 200"
        app = build_app(FrontendConfig(address=f"ipc://{tmp_path}/engine"), client)
        sent: list[dict[str, object]] = []

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        for stream in (True, False):
            sent.clear()
            await app(*_asgi_post(app, {"prompt": "Hello", "max_tokens": 5, "stream": stream}), send)
            assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503, sent[:1]
            body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))  # type: ignore[misc]
            assert body["error"]["code"] == "engine_error" and "no worker" in body["error"]["message"]
        assert client.num_live == 0


def _asgi_post(app: object, body: dict[str, object]) -> tuple[dict[str, object], object]:
    data = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json"),
                                                             (b"content-length", str(len(data)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}, "app": app}
    messages = [{"type": "http.request", "body": data, "more_body": False}]

    async def receive() -> dict[str, object]:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # the client stays
        return {"type": "http.disconnect"}

    return scope, receive


logging.getLogger("sluice.frontend").setLevel(logging.INFO)
