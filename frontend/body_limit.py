"""A cap on request bodies: 413 in the OpenAI error shape, before the handler buffers them.

A declared ``Content-Length`` over the cap is refused before a byte is read; a chunked body is
counted as it arrives and refused once it passes the cap, so no request can make the frontend
hold more than ``limit`` bytes of its body.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.errors import APIError


class _TooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._refuse(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _TooLarge
            return message

        # Only ``receive`` is wrapped: every chunk a stream writes goes through ``send``, and the
        # body is always read whole before a response starts, so a 413 can always be sent.
        try:
            await self.app(scope, counting_receive, send)
        except _TooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body is larger than {self.limit} bytes (--max-request-body)",
                         code="request_too_large")
        await error.response()(scope, receive, send)
