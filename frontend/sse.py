"""Writing a response's output to its client: the SSE stream, a whole answer, and the watchdog
that drops clients which stop reading.

The output processor renders every chunk before the writer runs (``frontend.output``); a writer
here only waits for buffered bytes and writes them, one write per wake-up. Its request's
lifetime is one ``RequestHandle`` around the whole response, from before the headers go out:
however the response ends (finished, client gone before or after the first chunk, a send that
raises, a stalled client dropped), leaving the handle aborts what still runs in the scheduler.

A stream's headers wait up to ``HEADERS_WAIT_S`` for its first output, so a request the engine
refuses at once (no worker) gets a 503 like any other request, not a 200 and an error event.

Uvicorn applies flow control: when a client stops reading, the socket buffers fill and the next
write waits. So a stalled stream never makes the frontend buffer its output without bound (its
text is merged into one pending chunk, see ``Output.emit``), and other streams are not slowed. A
write that stays blocked for ``--client-stall-timeout`` seconds means the client is gone in all
but name: ``StreamWatchdog`` (one task for all streams, instead of a timer around every write)
cancels that writer, which closes the connection and aborts the request. It also sends a
heartbeat on a stream silent for ``--sse-keepalive`` seconds (``KEEPALIVE``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable

from starlette.types import Receive, Scope, Send

from frontend.errors import APIError
from frontend.output import Output, RequestHandle
from frontend.render import SSE_DONE

log = logging.getLogger("sluice.frontend")

# Uvicorn reports a response left incomplete with one generic ERROR line; for a stream dropped
# here on purpose (already logged as such), that line would only mislead.
INCOMPLETE = "ASGI callable returned without completing response."
WATCHDOG_INTERVAL_S = 1.0
HEADERS_WAIT_S = 1.0  # a stream's headers wait this long for its first output (a refusal is a 503)
KEEPALIVE_S = 15.0  # the default --sse-keepalive: well inside the 60 s after which proxies (nginx) close
# The heartbeat: one bare line terminator, between two events. To an SSE parser that is an empty
# line with no data pending, which dispatches nothing (the SSE standard; the openai client's
# decoder, httpx-sse and browsers' EventSource all skip it), and clients that read lines skip
# blank ones. A comment (": keep-alive") is correct SSE too, but ``vllm bench serve`` strips each
# network read before splitting events on blank lines: a comment that arrived alone was glued to
# the next event and nothing after it parsed. A bare "\n" stripped is nothing, and is skipped.
KEEPALIVE = b"\n"


class _ExpectedIncomplete(logging.Filter):
    pending = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() == INCOMPLETE and self.pending:
            self.pending -= 1
            return False
        return True


_expected = _ExpectedIncomplete()
logging.getLogger("uvicorn.error").addFilter(_expected)


async def _watch_disconnect(receive: Receive, outputs: list[Output]) -> None:
    """The client hung up: the response stops (``take`` returns None, ``done`` is set)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    for output in outputs:
        output.hang_up()


def _sse_headers(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            *((k.lower().encode(), v.encode()) for k, v in headers.items())]


class StreamResponse:
    """``text/event-stream`` straight from an ``Output``'s buffer."""

    def __init__(self, handle: RequestHandle, headers: dict[str, str]) -> None:
        self.handle = handle
        self.headers = _sse_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        output = self.handle.output
        output.writer = asyncio.current_task()
        watcher = asyncio.create_task(_watch_disconnect(receive, [output]))
        write = scope.get("sluice.send", send)  # the server's own (``app.SluiceApp``)
        try:
            async with self.handle:
                first = await self._first_output(output)
                if output.error is not None and not output.produced:
                    # The engine refused it before any token (no worker, a failure): a plain 503,
                    # as a request that does not stream gets, rather than a stream of one error.
                    await _error(output).response()(scope, receive, send)
                    return
                await send({"type": "http.response.start", "status": 200, "headers": self.headers})
                data = first
                while data is not None:
                    output.write_started = time.monotonic()
                    await write({"type": "http.response.body", "body": data, "more_body": True})
                    output.last_write = output.write_started
                    output.write_started = 0.0
                    data = await output.take()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not output.stalled:
                raise
            # Dropped by the watchdog: the handle has aborted the request; returning without
            # completing the response makes uvicorn close the connection.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        finally:
            watcher.cancel()


    @staticmethod
    async def _first_output(output: Output) -> bytes | None:
        """The first bytes to write, if they come within ``HEADERS_WAIT_S``: headers wait that
        long for them, so a request the engine refuses at once gets a status that says so."""
        waiting = asyncio.ensure_future(output.take())
        done, _ = await asyncio.wait([waiting], timeout=HEADERS_WAIT_S)
        if done:
            return waiting.result()
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        return b""  # nothing yet: headers now, output as it comes


class BatchStreamResponse:
    """Several prompts' streams as one SSE response: each prompt's ``Output`` renders its own
    chunks (choices numbered across the prompts) and this writer interleaves them as they come,
    then ends with one usage chunk (``trailer``) and one [DONE]. An engine error in any part ends
    the whole response after its error chunk; leaving the handles aborts the rest."""

    def __init__(self, handles: list[RequestHandle], headers: dict[str, str],
                 trailer: Callable[[], bytes]) -> None:
        self.handles = handles
        self.trailer = trailer
        self.headers = _sse_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outputs = [handle.output for handle in self.handles]
        writer = asyncio.current_task()
        for output in outputs:
            output.writer = writer
        watcher = asyncio.create_task(_watch_disconnect(receive, outputs))
        write = scope.get("sluice.send", send)
        takes: dict[asyncio.Future[bytes | None], Output] = {}

        async def put(data: bytes) -> None:
            started = time.monotonic()
            for output in outputs:  # what the stall watchdog reads
                output.write_started = started
            await write({"type": "http.response.body", "body": data, "more_body": True})
            for output in outputs:
                output.last_write, output.write_started = started, 0.0

        try:
            async with contextlib.AsyncExitStack() as stack:
                for handle in self.handles:
                    await stack.enter_async_context(handle)
                takes = {asyncio.ensure_future(output.take()): output for output in outputs}
                # Headers wait for the first output, so that a refusal is a 503 (``StreamResponse``).
                await asyncio.wait(takes, timeout=HEADERS_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
                refused = next((o for o in outputs if o.error is not None), None)
                if refused is not None and not any(o.produced for o in outputs):
                    await _error(refused).response()(scope, receive, send)
                    return
                await send({"type": "http.response.start", "status": 200, "headers": self.headers})
                failed = False
                while takes and not failed:
                    ready, _ = await asyncio.wait(takes, return_when=asyncio.FIRST_COMPLETED)
                    for take in ready:
                        output = takes.pop(take)
                        data = take.result()
                        if data is None:
                            continue  # that prompt's stream is complete (or the client is gone)
                        await put(data)
                        failed = failed or output.error is not None
                        takes[asyncio.ensure_future(output.take())] = output
                if not any(output.gone for output in outputs):
                    await put((b"" if failed else self.trailer()) + SSE_DONE)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not any(output.stalled for output in outputs):
                raise
            if writer is not None:  # dropped by the watchdog, as ``StreamResponse``
                writer.uncancel()
        finally:
            for take in takes:
                take.cancel()
            watcher.cancel()


async def collect(handle: RequestHandle, receive: Receive) -> Output:
    """A non-streaming response's whole output, or a 400 nobody reads if the client hangs up
    first (the handle aborts the request either way)."""
    async with handle:
        await collect_all([handle.output], receive)
    return handle.output


async def collect_all(outputs: list[Output], receive: Receive) -> None:
    """Wait until every output is complete (the caller holds their handles); a 400 nobody reads
    if the client hangs up first, a 503 if the engine failed any of them."""
    watcher = asyncio.create_task(_watch_disconnect(receive, outputs))
    try:
        for output in outputs:
            await output.done.wait()
            if output.gone or output.error is not None:
                break
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    if any(output.gone for output in outputs):
        raise APIError(400, "client disconnected")
    failed = next((output for output in outputs if output.error is not None), None)
    if failed is not None:
        raise _error(failed)


def _error(output: Output) -> APIError:
    """What a response that ended in an error before its first token answers: 503 when the engine
    failed it, 500 when the server's own output path did."""
    assert output.error is not None
    code = "internal_error" if output.error_status == 500 else "engine_error"
    return APIError(output.error_status, output.error, code=code)


class StreamWatchdog:
    """Looks at every stream once a second: drops one whose write has been blocked for
    ``timeout`` seconds (between ``timeout`` and ``timeout + 1`` seconds in), and gives one that
    has been silent for ``keepalive`` seconds a heartbeat (clients skip it; proxies that close idle
    connections see traffic) — while a request waits in a long queue, a paused one, or one whose
    worker is being restarted. ``keepalive`` 0: no heartbeats."""

    def __init__(self, outputs: Callable[[], Iterable[Output]], timeout: float,
                 keepalive: float = KEEPALIVE_S) -> None:
        self._outputs = outputs
        self.timeout = timeout
        self.keepalive = keepalive

    async def run(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        for output in list(self._outputs()):
            if output.writer is None or output.stalled:
                continue  # not a stream being written
            started = output.write_started
            if started and now - started > self.timeout:
                log.warning("a client read nothing for %.0f s: stream dropped, request aborted", self.timeout)
                output.stalled = True
                _expected.pending += 1
                output.writer.cancel()
            elif (self.keepalive and not started and output.last_write and now - output.last_write >= self.keepalive
                  and not output.buffer and not output.closed):
                output.last_write = now
                output.put(KEEPALIVE)
