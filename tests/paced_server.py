"""A stand-in OpenAI-compatible server whose stream timing is known exactly, for ``sluice bench``'s tests.

Every streamed request gets its first token ``ttft`` seconds after it arrived, then one token every
``itl`` seconds (deadlines from the arrival, so late wake-ups do not accumulate), ``max_tokens``
tokens in all, then a usage chunk and ``data: [DONE]``. With ``thinking``, a chat reply's first
``thinking`` tokens are ``delta.reasoning_content``, as a reasoning model's are. Prompt tokens are
counted one per word (a list prompt: one per id). Two priorities misbehave on purpose: 9 answers
HTTP 503, 8 breaks the connection after two tokens. It runs (Starlette on uvicorn) in a thread of
the test process, so its ``time.perf_counter`` stamps compare directly with the client's.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from sluice_server import free_port
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

FAIL_HTTP_PRIORITY = 9
BREAK_STREAM_PRIORITY = 8


class PacedServer:
    def __init__(self, ttft: float = 0.2, itl: float = 0.05, thinking: int = 0) -> None:
        self.ttft, self.itl, self.thinking = ttft, itl, thinking
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.arrivals: list[float] = []  # perf_counter of each streamed request's arrival
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        app = Starlette(routes=[Route("/v1/models", self.models), Route("/v1/completions", self.generate, methods=["POST"]),
                                Route("/v1/chat/completions", self.generate, methods=["POST"])])
        # log_level critical: the deliberately broken streams would log tracebacks.
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical",
                                                     lifespan="off", timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "paced", "object": "model"}]})

    @staticmethod
    def prompt_tokens(body: dict[str, Any]) -> int:
        prompt = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        return len(prompt) if isinstance(prompt, list) else len(prompt.split())

    async def generate(self, request: Request) -> Response:
        arrived = time.perf_counter()
        body = await request.json()
        self.arrivals.append(arrived)
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if body.get("priority") == FAIL_HTTP_PRIORITY:
            self.in_flight -= 1
            return JSONResponse({"error": {"message": "paced server: overloaded on purpose"}}, status_code=503)
        chat = "messages" in body
        n = int(body["max_tokens"])

        def chunk(i: int) -> dict[str, Any]:
            reason = "length" if i == n - 1 else None
            delta = {"reasoning_content": f" r{i}"} if i < self.thinking else {"content": f" t{i}"}
            choice = {"index": 0, "delta": delta} if chat else {"index": 0, "text": f" t{i}"}
            return {"id": "x", "object": "chunk", "choices": [choice | {"finish_reason": reason}]}

        async def events() -> AsyncIterator[bytes]:
            try:
                for i in range(n):
                    await asyncio.sleep(max(0.0, arrived + self.ttft + i * self.itl - time.perf_counter()))
                    if i == 2 and body.get("priority") == BREAK_STREAM_PRIORITY:
                        raise ConnectionAbortedError("paced server: stream broken on purpose")
                    yield b"data: " + json.dumps(chunk(i)).encode() + b"\n\n"
                usage = {"prompt_tokens": self.prompt_tokens(body), "completion_tokens": n,
                         "total_tokens": self.prompt_tokens(body) + n}
                yield b"data: " + json.dumps({"id": "x", "choices": [], "usage": usage}).encode() + b"\n\n"
            finally:
                # Before [DONE]: a client that starts its next request on [DONE] must not find
                # this one still counted.
                self.in_flight -= 1
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the paced server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


@contextmanager
def paced_server(ttft: float = 0.2, itl: float = 0.05, thinking: int = 0) -> Iterator[PacedServer]:
    server = PacedServer(ttft, itl, thinking)
    server.start()
    try:
        yield server
    finally:
        server.stop()
