"""Streaming responses that drop clients which stop reading.

Uvicorn applies flow control: when a client stops reading, the socket buffers fill and the next
write waits. So a stalled stream never makes the frontend buffer its output without bound (its
tokens wait as integers in the request's stream, at most ``max_tokens`` of them, and chunks are
made one at a time), and other streams are not slowed. A write that stays blocked for
``stall_timeout`` seconds means the client is gone in all but name: the stream is dropped (the
connection closed) and its generator closed, which aborts the request in the scheduler and
frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Send

log = logging.getLogger("sluice.frontend")

# Uvicorn reports a response left incomplete with one generic ERROR line; for a stream dropped
# here on purpose (already logged as such), that line would only mislead.
INCOMPLETE = "ASGI callable returned without completing response."


class _ExpectedIncomplete(logging.Filter):
    pending = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() == INCOMPLETE and self.pending:
            self.pending -= 1
            return False
        return True


_expected = _ExpectedIncomplete()
logging.getLogger("uvicorn.error").addFilter(_expected)


class DroppingStreamingResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[bytes], stall_timeout: float, **kwargs: object) -> None:
        super().__init__(content, **kwargs)  # type: ignore[arg-type]
        self.stall_timeout = stall_timeout
        self._content = content

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self._content:
                try:
                    await asyncio.wait_for(send({"type": "http.response.body", "body": chunk, "more_body": True}),
                                           self.stall_timeout)
                except TimeoutError:
                    log.warning("a client read nothing for %.0f s: stream dropped, request aborted",
                                self.stall_timeout)
                    _expected.pending += 1
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose = getattr(self._content, "aclose", None)
            if aclose is not None:
                await aclose()  # ends the generation now: its request is aborted, blocks freed
