"""A lean HTTP/1.1 client for one streamed POST: asyncio streams, no HTTP library.

A load generator shares the machine with the server it measures. httpx parses every response
in pure Python (h11), which on a 2-core machine took enough CPU from the server to slow it
measurably: the same server and workload gave 35% fewer output tokens/s measured by ``sluice
bench`` than by vLLM's ``benchmark_serving.py`` (aiohttp, C parser). Reading the status line,
the headers and then the chunked body line by line with ``StreamReader`` costs a fraction of it.

One connection per request (``Connection: close``): no pool to manage, and the cost of a
loopback connect is nothing beside a generation.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import msgspec

MAX_LINE = 1 << 20  # an SSE line (one chunk's JSON) can be long with logprobs


class ProtocolError(Exception):
    """The server's answer is not HTTP/1.1 as expected."""


class Response:
    """An open response: ``status``, ``headers``; the body through ``lines`` or ``read``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int,
                 headers: dict[str, str]) -> None:
        self.status, self.headers = status, headers
        self._reader, self._writer = reader, writer

    async def _chunks(self) -> AsyncIterator[bytes]:
        """The body's pieces: de-chunked (Transfer-Encoding: chunked), sized, or up to EOF."""
        reader = self._reader
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await reader.readline()
                if not size_line:
                    raise ProtocolError("the connection closed inside a chunked body")
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    return
                data = await reader.readexactly(size + 2)  # the chunk and its CRLF
                yield data[:-2]
        elif "content-length" in self.headers:
            yield await reader.readexactly(int(self.headers["content-length"]))
        else:
            while data := await reader.read(65536):
                yield data

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines as they arrive, without their line ends."""
        pending = b""
        async for data in self._chunks():
            pending += data
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield line.rstrip(b"\r")
        if pending:
            yield pending.rstrip(b"\r")

    async def read(self) -> bytes:
        return b"".join([data async for data in self._chunks()])

    def close(self) -> None:
        self._writer.close()


async def post(url: str, body: object, headers: dict[str, str] | None = None) -> Response:
    """POST ``body`` as JSON to ``url`` and return once the status line and headers are in."""
    parts = urlsplit(url)
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    host = parts.hostname or "127.0.0.1"
    reader, writer = await asyncio.open_connection(host, port, ssl=ssl.create_default_context() if https else None,
                                                   limit=MAX_LINE)
    try:
        payload = msgspec.json.encode(body)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = [f"POST {target} HTTP/1.1", f"Host: {parts.netloc}", "Content-Type: application/json",
                f"Content-Length: {len(payload)}", "Accept: text/event-stream, application/json",
                "Connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        writer.write("\r\n".join(head).encode() + b"\r\n\r\n" + payload)
        await writer.drain()
        status_line = await reader.readline()
        fields = status_line.split(None, 2)
        if len(fields) < 2 or not fields[0].startswith(b"HTTP/1.") or not fields[1].isdigit():
            raise ProtocolError(f"not an HTTP/1.1 status line: {status_line[:80]!r}")
        response_headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            response_headers[name.strip().lower()] = value.strip()
        return Response(reader, writer, int(fields[1]), response_headers)
    except BaseException:
        writer.close()
        raise
