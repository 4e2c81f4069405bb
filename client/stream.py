"""One streaming request, timed chunk by chunk, the way ``vllm bench serve`` times it.

Definitions (so that figures compare with ``vllm bench serve``'s; all times on the client's
``time.perf_counter`` clock, a chunk's time being when its SSE ``data:`` line was read):

- **token chunk**: a data chunk with a non-empty ``choices`` list. Its text may be empty (a special
  token, or a token that ends inside a UTF-8 character): a token still arrived. The trailing usage
  chunk (``choices: []``) is not one. This is vLLM's rule rather than "chunks with non-empty
  text"; the two agree wherever a server sends one chunk per token with its text.
- **TTFT**: from sending the request to the first token chunk.
- **ITL**: each gap between consecutive token chunks of a request (a chunk carrying several tokens
  is one gap, as in vLLM).
- **latency (E2EL)**: from sending to the last token chunk.
- **output tokens**: ``usage.completion_tokens`` of the usage chunk (``stream_options.include_usage``)
  when the server sends one, else the number of token chunks. **Prompt tokens**: ``usage.prompt_tokens``.

A request fails on an HTTP error status, a connection or protocol error, an ``error`` chunk, a
stream with no token chunk, a stream that ends before ``data: [DONE]``, or the ``--timeout``
deadline; the record keeps the reason. A failed request's partial timings stay in its record but
count in no statistic.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from client import sse_http
from client.workload import RequestSpec

T = TypeVar("T")

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestRecord:
    """What one request did. Times in seconds; ``start`` from the beginning of the run."""

    index: int
    priority: int | None
    input_len: int  # intended prompt tokens (0: unknown)
    max_tokens: int
    label: str | None = None  # the request's class in a scenario (RequestSpec.label)
    start: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None  # send -> last token chunk
    done: float | None = None  # send -> the stream closed (for concurrency accounting)
    prompt_tokens: int | None = None  # the server's count (usage)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where reported
    output_tokens: int = 0
    usage_reported: bool = False
    status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def token_chunks(self) -> int:
        return 0 if self.ttft is None else 1 + len(self.itl)


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop where it is installed: the client's event loop costs the server
    on the same machine less CPU."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def request_body(spec: RequestSpec, model: str, endpoint: str, ignore_eos: bool,
                 temperature: float | None = 0.0) -> dict[str, Any]:
    """The JSON body. ``max_tokens`` on both endpoints: every OpenAI-compatible server takes it
    (``max_completion_tokens``, which ``vllm bench serve`` sends for chat, is newer). ``ignore_eos``
    (vLLM, SGLang, Sluice) alone makes the server generate exactly ``max_tokens``, as no stop
    strings are sent; no ``min_tokens`` is sent, since it would only matter on a server that
    ignores ``ignore_eos`` (the report warns when outputs come out short). ``priority`` is sent
    only when the workload sets one: a server without priority scheduling may refuse the field.
    ``temperature`` 0 (greedy) by default, as ``vllm bench serve`` sends: a server's default (1,
    random sampling) can cost a CPU server a large share of a step, and figures from two clients
    compare only when both ask for the same sampling."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if temperature is not None:
        body["temperature"] = temperature
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if ignore_eos and not spec.extra:
        body["ignore_eos"] = True
    if spec.priority is not None:
        body["priority"] = spec.priority
    return body | dict(spec.extra or {})


def _error_text(response_body: bytes, status: int) -> str:
    try:
        message = json.loads(response_body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response_body.decode(errors="replace").strip()[:300]
    return f"HTTP {status}: {message}"


def _apply_usage(record: RequestRecord, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    if isinstance(usage.get("completion_tokens"), int):
        record.output_tokens = usage["completion_tokens"]
        record.usage_reported = True
    if isinstance(usage.get("prompt_tokens"), int):
        record.prompt_tokens = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        record.cached_tokens = details["cached_tokens"]


_decode = msgspec.json.Decoder().decode


async def _read_stream(response: sse_http.Response, record: RequestRecord, sent: float,
                       on_token: Callable[[], None] | None) -> None:
    last = sent
    done = False
    async for line in response.lines():
        now = time.perf_counter()
        if not line.startswith(b"data:"):  # blank separators, ": ping" comments, event: lines
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            break
        try:
            chunk = _decode(payload)
        except msgspec.DecodeError:
            chunk = None
        if not isinstance(chunk, dict):
            raise ValueError(f"malformed chunk: {payload[:100]!r}")
        if "error" in chunk:
            error = chunk["error"]
            raise ValueError(f"error chunk: {error.get('message') if isinstance(error, dict) else error}")
        if chunk.get("choices"):
            if record.ttft is None:
                record.ttft = now - sent
            else:
                record.itl.append(now - last)
            last = now
            if on_token is not None:
                on_token()
        # Usage may ride on any chunk (vLLM's continuous usage stats); the last one wins.
        _apply_usage(record, chunk.get("usage"))
    if record.ttft is None:
        raise ValueError("the stream carried no token")
    if not done:
        raise ValueError("the stream ended before data: [DONE]")
    record.latency = last - sent
    if not record.usage_reported:
        record.output_tokens = record.token_chunks


async def stream_request(url: str, body: dict[str, Any], record: RequestRecord, *, t0: float,
                         timeout: float | None, headers: dict[str, str] | None = None,
                         on_token: Callable[[], None] | None = None) -> RequestRecord:
    """POST ``body`` to ``url`` and fill ``record`` (see the module's definitions). Never raises
    for a failure of the request: it lands in ``record.error``. The request goes through
    ``sse_http`` rather than an HTTP library: the client must take as little CPU as it can from
    a server on the same machine."""
    sent = time.perf_counter()
    record.start = sent - t0
    response: sse_http.Response | None = None
    try:
        async with asyncio.timeout(timeout):
            response = await sse_http.post(url, body, headers)
            record.status = response.status
            if response.status != 200:
                record.error = _error_text(await response.read(), response.status)
            else:
                await _read_stream(response, record, sent, on_token)
    except TimeoutError:
        record.error = f"no complete answer within --timeout {timeout} s"
    except (sse_http.ProtocolError, asyncio.IncompleteReadError, OSError) as e:
        record.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    except ValueError as e:
        record.error = str(e)
    finally:
        if response is not None:
            response.close()
    record.done = time.perf_counter() - sent
    if record.error is not None:
        record.latency = None
    return record
