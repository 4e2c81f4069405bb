"""One streamed reply from an OpenAI-compatible server, written to the terminal as it arrives.

Shared by ``sluice chat`` and ``sluice complete``. Their ``run`` imports this module lazily: it
pulls in httpx and rich, which the parser of every ``sluice`` command should not pay for.

Streamed text goes to stdout unstyled and flushed per chunk, so it can be piped; notes, stats
and errors go to stderr (dim or red on a terminal, plain otherwise). A reasoning model's thinking
(``delta.reasoning_content``) streams before its answer, set apart from it (``TextOut.thought``).

Interrupting is the caller's part: a Ctrl-C while ``Server.stream`` reads raises
KeyboardInterrupt out of it, and leaving httpx's ``stream`` block closes the response. A
response not read to its end is never put back in the pool: its connection is closed, which is
how the server learns that nobody reads any more (Sluice and vLLM then abort the request and
free its KV cache).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from rich.console import Console

# No read timeout: a reply may legitimately wait long in a busy server's queue or prefill, and
# Ctrl-C is the way out. Connecting to a server that is not there should fail fast.
TIMEOUT = httpx.Timeout(None, connect=10.0)

_stderr = Console(stderr=True, highlight=False, soft_wrap=True)
_stdout = Console(highlight=False, soft_wrap=True, emoji=False)
THINKING = "thinking: "  # begins each line of thinking written off a terminal


class RequestFailed(Exception):
    """The request did not produce a reply: server unreachable, connection lost, HTTP error or an
    error in the stream. ``str()`` is one line for the user."""


def note(text: str) -> None:
    """A line on stderr that is not the model's text: ``[interrupted]``, stats, hints."""
    _stderr.print(text, style="dim", markup=False)


def error(message: str) -> None:
    _stderr.print(f"sluice: error: {message}", style="red", markup=False)


class TextOut:
    """The model's text on stdout: unstyled, flushed per chunk (a pipe would otherwise hold it
    back until the end), remembering whether its last line is open so that a note on stderr
    after an interrupted reply starts on a line of its own.

    A reasoning model's thinking (``thought``) is not the reply. On a terminal it is shown dim
    and italic as it streams, and the answer starts after a blank line; off a terminal (or on
    one that takes no styles, TERM=dumb) stdout keeps just the replies, and the thinking goes to
    stderr, each of its lines begun with ``THINKING``."""

    def __init__(self) -> None:
        self.line_open = False
        self._screen = _stdout.is_terminal and _stdout.color_system is not None
        self._thinking = False  # thinking was written, and no answer after it yet
        self._thought_open = False  # off a terminal: the last line of thinking on stderr is open

    def __call__(self, text: str) -> None:
        if text:
            self._end_thinking(blank_line=True)
            sys.stdout.write(text)
            sys.stdout.flush()
            self.line_open = not text.endswith("\n")

    def thought(self, text: str) -> None:
        if not text:
            return
        self._thinking = True
        if self._screen:
            _stdout.print(text, style="dim italic", end="", markup=False)
            self.line_open = not text.endswith("\n")
            return
        marked = []
        for line in text.splitlines(keepends=True):
            marked.append(line if self._thought_open else THINKING + line)
            self._thought_open = not line.endswith("\n")
        sys.stderr.write("".join(marked))
        sys.stderr.flush()

    def _end_thinking(self, blank_line: bool) -> None:
        if not self._thinking:
            return
        self._thinking = False
        if self._screen:
            sys.stdout.write("\n" * (self.line_open + blank_line))
            sys.stdout.flush()
            self.line_open = False
        elif self._thought_open:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._thought_open = False

    def end_line(self) -> None:
        self._end_thinking(blank_line=False)
        if self.line_open:
            self("\n")

    def end_reply(self) -> None:
        """The newline after a reply (after its thinking, where it is all thinking)."""
        self._end_thinking(blank_line=False)
        self("\n")


def stdout_closed() -> int:
    """The exit status once the reader of stdout has gone (``| head``): 141, as for a program
    that SIGPIPE ended. stdout now points at devnull, or Python's own flush at exit would fail
    again and print a traceback."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141


@dataclass(frozen=True)
class Reply:
    text: str
    finish_reason: str | None  # None when the stream ended without saying
    ttft_s: float | None  # request sent -> first text; None if no text came
    total_s: float  # request sent -> last text
    count: int  # completion tokens from the usage chunk, else text chunks
    unit: str  # "tokens" or "chunks": what ``count`` counts

    def stats_line(self) -> str:
        parts = []
        if self.ttft_s is not None:
            parts.append(f"ttft {self.ttft_s:.2f} s")
        # Over the whole reply, not from the first token on: servers that run several decode
        # steps per scheduling round (Sluice, vLLM) send tokens in bursts, and a short reply
        # that arrives in one burst would show a rate of thousands.
        if self.count and self.total_s > 0:
            parts.append(f"{self.count / self.total_s:.1f} {'tok' if self.unit == 'tokens' else 'chunks'}/s")
        parts.append(f"{self.count} {self.unit}")
        return "[" + ", ".join(parts) + "]"


class Server:
    """An HTTP client of one server; ``with Server(...) as server:`` closes its connections."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url = url
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(base_url=url, headers=headers, timeout=TIMEOUT)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.close()

    def first_model(self) -> str:
        with self._failures():
            response = self._client.get("/v1/models")
        _raise_for_status(response)
        try:
            return str(response.json()["data"][0]["id"])
        except (ValueError, LookupError, TypeError):
            raise RequestFailed(f"{self.url}/v1/models lists no model; name one with --model") from None

    def stream(self, path: str, body: dict[str, Any], write: Callable[[str], None],
               think: Callable[[str], None] | None = None) -> Reply:
        """POST ``body`` (with ``stream: true``) to ``path`` and ``write`` each piece of text of
        choice 0 as it arrives, for /v1/completions and /v1/chat/completions alike; ``think``
        each piece of its reasoning (a chat's ``delta.reasoning_content``), which the reply's
        ``text`` leaves out."""
        parts: list[str] = []
        finish_reason: str | None = None
        usage_tokens: int | None = None
        chunks = 0
        first = last = 0.0
        start = time.perf_counter()
        with self._failures(), self._client.stream("POST", path, json=body) as response:
            if response.is_error:
                response.read()
                _raise_for_status(response)
            for event in _events(response):
                if event.get("error"):  # an error after the headers travels as a chunk
                    raise RequestFailed(_error_text(event) or "the server's stream reported an error")
                if isinstance(event.get("usage"), dict):
                    usage_tokens = event["usage"].get("completion_tokens", usage_tokens)
                for choice in event.get("choices") or ():
                    if choice.get("index", 0) != 0:
                        continue
                    text, reasoning = _choice_text(choice), _choice_reasoning(choice)
                    if text or reasoning:
                        last = time.perf_counter()
                        if not chunks:
                            first = last
                        chunks += 1
                    if reasoning and think is not None:
                        think(reasoning)
                    if text:
                        parts.append(text)
                        write(text)
                    finish_reason = choice.get("finish_reason") or finish_reason
        return Reply(
            text="".join(parts), finish_reason=finish_reason,
            ttft_s=first - start if chunks else None, total_s=last - start if chunks else 0.0,
            count=usage_tokens if usage_tokens is not None else chunks,
            unit="tokens" if usage_tokens is not None else "chunks",
        )

    @contextlib.contextmanager
    def _failures(self) -> Iterator[None]:
        """httpx's transport errors as one line each."""
        try:
            yield
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.UnsupportedProtocol) as e:
            raise RequestFailed(f"cannot reach {self.url}: {_describe(e)}") from None
        except httpx.TransportError as e:
            raise RequestFailed(f"connection to {self.url} failed: {_describe(e)}") from None


def _events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, up to ``[DONE]``. Other lines (blank
    separators, ``: keep-alive`` comments, ``event:`` names) carry nothing for us."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise RequestFailed(f"the server sent a chunk that is not JSON: {data[:200]!r}") from None
        if isinstance(event, dict):
            yield event


def _choice_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:  # chat; the first chunk may carry only the role
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


def _choice_reasoning(choice: dict[str, Any]) -> str:
    """A chat chunk's thinking: ``reasoning_content`` (Sluice, SGLang, DeepSeek's API), or
    ``reasoning`` (vLLM's newer releases)."""
    delta = choice.get("delta") or {}
    return delta.get("reasoning_content") or delta.get("reasoning") or ""


def _raise_for_status(response: httpx.Response) -> None:
    if response.is_error:
        message = (_error_text(_json_or_none(response)) or " ".join(response.text.split())[:300]
                   or response.reason_phrase)
        raise RequestFailed(f"HTTP {response.status_code}: {message}")


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _error_text(body: Any) -> str:
    """The message of an error body, on one line: OpenAI's ``{"error": {"message"}}``, also
    older vLLM's top-level ``message`` and FastAPI's ``detail``; empty if none of those."""
    if not isinstance(body, dict):
        return ""
    err = body.get("error")
    message = err.get("message") if isinstance(err, dict) else err
    message = message or body.get("message") or body.get("detail") or ""
    return " ".join(str(message).split())


def _describe(e: Exception) -> str:
    return str(e) or type(e).__name__
