"""OpenAI's response shapes, rendered: SSE chunks while streaming, whole bodies otherwise.

A renderer is chosen once per request, when it is admitted, for its endpoint and its options.
The chunk of a plain token (no logprobs, no token ids asked for) is the hot path of every stream:
it is a prefix and a suffix made once, around the token's text as a JSON string, with no dict
built and no encoder walking one. Anything richer goes through a dict and msgspec.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from frontend.tokenizer import IncrementalDetokenizer, ModelTokenizer
from frontend.tool_calls import ToolCallParser, parse_llama3_call
from frontend.tools import ToolUse
from protocol.messages import Logprob, PromptLogprob

_json = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: object) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def error_chunk(message: str, code: str = "engine_error") -> bytes:
    """A failure after the headers went out travels as a chunk in OpenAI's error shape: an engine
    that failed (``engine_error``), or the server's own output path (``internal_error``)."""
    kind = "server_error" if code == "internal_error" else "service_unavailable"
    return sse({"error": {"message": message, "type": kind, "param": None, "code": code}})


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               reasoning_tokens: int | None = None) -> dict[str, object]:
    """``reasoning_tokens``: of the completion tokens, those of think blocks (OpenAI's
    ``completion_tokens_details``), when the answers are split into reasoning and content."""
    usage: dict[str, object] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


class Piece(Protocol):
    """What a renderer reads of one choice's output so far (``output.Choice``)."""

    index: int
    text_offset: int
    first_chunk: bool

    @property
    def prompt_logprobs(self) -> list[PromptLogprob] | None: ...


class Renderer(Protocol):
    """``text`` is a choice's content; ``reasoning``, where the answer is split into reasoning and
    content (chat and responses, ``frontend.reasoning``), its think block's text before it (None
    in an answer that is not split). Others never get any."""

    endpoint: str  # the route whose answers it renders (the admin API and the metrics say it)
    plain: bool  # ``token`` may be used: chunks carry text only
    stream_end: bytes  # what a stream ends with, after its last chunk (and usage chunk)

    def token(self, choice: Piece, text: str, reasoning: bool = False) -> bytes: ...

    def chunk(self, choice: Piece, text: str, token_ids: list[int], logprobs: list[Logprob],
              finish_reason: str | None, abort_reason: str | None, reasoning: str = "") -> bytes: ...

    def answer(self, choice: Piece, text: str, token_ids: list[int], logprobs: list[Logprob],
               finish_reason: str, abort_reason: str | None, reasoning: str | None = None) -> dict[str, Any]: ...

    def body(self, choices: list[dict[str, Any]], usage: dict[str, object],
             prompt_logprobs: list[PromptLogprob] | None = None) -> dict[str, Any]: ...

    def usage_chunk(self, usage: dict[str, object]) -> bytes: ...

    def error(self, message: str, code: str) -> bytes: ...


class _Base:
    object_name = ""
    chunk_object = ""
    stream_end = SSE_DONE

    def __init__(self, request_id: str, created: int, model: str, tokenizer: ModelTokenizer,
                 prompt_ids: list[int], return_token_ids: bool, prompt_logprobs: int | None = None) -> None:
        self.request_id, self.created, self.model = request_id, created, model
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        self.return_token_ids = return_token_ids
        self.prompt_logprobs = prompt_logprobs  # vLLM's field: how many alternatives per prompt token
        self._scored: list[dict[str, dict[str, Any]] | None] | None = None
        self._head = (b'data: {"id":' + _json.encode(request_id) + b',"object":"' + self.chunk_object.encode()
                      + b'","created":%d,"model":' % created + _json.encode(model) + b',"choices":[{"index":')

    def _envelope(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.request_id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": [choice]}

    def body(self, choices: list[dict[str, Any]], usage: dict[str, object],
             prompt_logprobs: list[PromptLogprob] | None = None) -> dict[str, Any]:
        return {"id": self.request_id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}

    def _vllm_prompt_logprobs(self, entries: list[PromptLogprob] | None) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs``: None for the first prompt token, then for each one a map
        from token id to ``{logprob, rank, decoded_token}`` holding the token itself and the
        ``prompt_logprobs`` most likely ones (rendered once; every choice shows the same)."""
        if self._scored is None:
            if entries is None:  # never computed (the request ended before its first token)
                return [None] * len(self.prompt_ids)
            token_str, k = self.tokenizer.token_str, self.prompt_logprobs or 0
            scored: list[dict[str, dict[str, Any]] | None] = [None]
            for token, (logprob, rank, ids, logprobs) in zip(self.prompt_ids[1:], entries, strict=True):
                position = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": token_str(token)}}
                for j, (t, lp) in enumerate(zip(ids[:k], logprobs[:k], strict=True)):
                    position.setdefault(str(t), {"logprob": lp, "rank": j + 1, "decoded_token": token_str(t)})
                scored.append(position)
            self._scored = scored
        return self._scored

    def usage_chunk(self, usage: dict[str, object]) -> bytes:
        return sse({"id": self.request_id, "object": "usage", "choices": [], "usage": usage})

    def error(self, message: str, code: str) -> bytes:
        return error_chunk(message, code)


def _with_abort_reason(choice: dict[str, Any], finish_reason: str | None, abort_reason: str | None) -> dict[str, Any]:
    """A choice the server aborted (``--request-timeout``) says why, beside ``finish_reason``."""
    if abort_reason is not None and finish_reason == "abort":
        choice["abort_reason"] = abort_reason
    return choice


class CompletionRenderer(_Base):
    """``echo``: each choice's text starts with the prompt (as given, or its token ids decoded),
    and with ``logprobs`` its logprobs start with the prompt tokens' (the first token has none),
    as OpenAI's legacy completions gave them: what evaluation harnesses score prompts by."""

    endpoint = "/v1/completions"
    object_name = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, request_id: str, created: int, model: str, tokenizer: ModelTokenizer, prompt_ids: list[int],
                 return_token_ids: bool, logprobs: int | None, echo: bool = False,
                 prompt_logprobs: int | None = None, prompt_text: str | None = None) -> None:
        super().__init__(request_id, created, model, tokenizer, prompt_ids, return_token_ids, prompt_logprobs)
        self.logprobs = logprobs
        self.echo = echo
        self.prompt_text = prompt_text  # a prompt given as text is echoed as it was given
        self.plain = logprobs is None and not return_token_ids and not echo and prompt_logprobs is None
        self._prefixes: dict[int, bytes] = {}
        self._prompt_pieces: list[str] | None = None

    def token(self, choice: Piece, text: str, reasoning: bool = False) -> bytes:
        prefix = self._prefixes.get(choice.index)
        if prefix is None:
            prefix = self._prefixes[choice.index] = self._head + b'%d,"text":' % choice.index
        return prefix + _json.encode(text) + b',"finish_reason":null,"logprobs":null}]}\n\n'

    def _pieces(self) -> list[str]:
        """The prompt's text, token by token, special tokens included (as ``/detokenize``
        gives it; decoded once, for every choice)."""
        if self._prompt_pieces is None:
            detok = IncrementalDetokenizer(self.tokenizer, [], skip_special_tokens=False)
            pieces = [detok.push(t) for t in self.prompt_ids]
            # The BOS the server put before a text prompt is not the client's text: it takes none.
            if self.prompt_text is not None and pieces and self.prompt_ids[0] == self.tokenizer.info.bos_token_id \
                    and not self.prompt_text.startswith(pieces[0]):
                pieces[0] = ""
            self._prompt_pieces = pieces
        return self._prompt_pieces

    def _echoed(self, choice: Piece, text: str, token_ids: list[int], entries: list[Logprob],
                texts: list[str]) -> tuple[str, list[int], list[Logprob], list[str]]:
        """The prompt before a choice's first output: its text, and its tokens for logprobs."""
        pieces = self._pieces()
        scored, k = choice.prompt_logprobs, self.logprobs or 0  # (the worker may hold more: prompt_logprobs)
        prompt_entries: list[Logprob] = [(lp, ids[:k], lps[:k]) for lp, _, ids, lps in scored] \
            if scored is not None else [None] * (len(self.prompt_ids) - 1)
        prompt = self.prompt_text if self.prompt_text is not None else "".join(pieces)
        return prompt + text, self.prompt_ids + token_ids, [None, *prompt_entries, *entries], pieces + texts

    def _logprobs(self, choice: Piece, token_ids: list[int], entries: list[Logprob],
                  texts: list[str]) -> dict[str, Any] | None:
        if self.logprobs is None or not token_ids:
            return None
        token_str = self.tokenizer.token_str
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entry, text in zip(token_ids, entries, texts, strict=True):
            token = token_str(tid)
            out["tokens"].append(token)
            out["token_logprobs"].append(entry[0] if entry else None)
            top = None
            if entry:
                # OpenAI's legacy rule: the chosen token is always among them (up to logprobs + 1).
                top = {token_str(t): lp for t, lp in zip(entry[1], entry[2], strict=True)}
                top.setdefault(token, entry[0])
            out["top_logprobs"].append(top)
            out["text_offset"].append(choice.text_offset)
            choice.text_offset += len(text)
        return out

    def chunk(self, choice: Piece, text: str, token_ids: list[int], logprobs: list[Logprob],
              finish_reason: str | None, abort_reason: str | None, reasoning: str = "") -> bytes:
        # A chunk's text offsets: its text counts once, at its first token (a backlog's merged
        # chunk never has logprobs, so one text per token is what a logprobs chunk holds).
        texts = [text] + [""] * (len(token_ids) - 1) if token_ids else []
        shown_ids = token_ids
        if self.echo and choice.first_chunk:
            text, shown_ids, logprobs, texts = self._echoed(choice, text, token_ids, logprobs, texts)
        body = {"index": choice.index, "text": text, "finish_reason": finish_reason,
                "logprobs": self._logprobs(choice, shown_ids, logprobs, texts)}
        if self.return_token_ids:
            body["token_ids"] = token_ids
            if choice.first_chunk:
                body["prompt_token_ids"] = self.prompt_ids
        if self.prompt_logprobs is not None and choice.first_chunk:
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(choice.prompt_logprobs)
        choice.first_chunk = False
        return sse(self._envelope(_with_abort_reason(body, finish_reason, abort_reason)))

    def answer(self, choice: Piece, text: str, token_ids: list[int], logprobs: list[Logprob],
               finish_reason: str, abort_reason: str | None, reasoning: str | None = None) -> dict[str, Any]:
        texts = [self.tokenizer.decode([t]) for t in token_ids] if self.logprobs is not None else []
        shown_ids = token_ids
        if self.echo:
            text, shown_ids, logprobs, texts = self._echoed(choice, text, token_ids, logprobs, texts)
        body = {"index": choice.index, "text": text, "finish_reason": finish_reason,
                "logprobs": self._logprobs(choice, shown_ids, logprobs, texts)}
        if self.return_token_ids:
            body.update(token_ids=token_ids, prompt_token_ids=self.prompt_ids)
        if self.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(choice.prompt_logprobs)
        return _with_abort_reason(body, finish_reason, abort_reason)


class ChatRenderer(_Base):
    """A split answer's think block is the message's ``reasoning_content`` (null when empty) and
    streams as ``delta.reasoning_content``, before the ``delta.content`` of the rest; the tool
    call parser reads the content only."""

    endpoint = "/v1/chat/completions"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, request_id: str, created: int, model: str, tokenizer: ModelTokenizer, prompt_ids: list[int],
                 return_token_ids: bool, top_logprobs: int | None, tools: ToolUse | None = None,
                 prompt_logprobs: int | None = None) -> None:
        super().__init__(request_id, created, model, tokenizer, prompt_ids, return_token_ids, prompt_logprobs)
        self.top_logprobs = top_logprobs
        # With tools the model may call, each choice's text goes through its call parser.
        self.tools = tools if tools is not None and tools.parses else None
        self.plain = top_logprobs is None and self.tools is None and prompt_logprobs is None
        self._prefixes: dict[tuple[int, bool, bool], bytes] = {}
        self._parsers: dict[int, ToolCallParser] = {}

    def token(self, choice: Piece, text: str, reasoning: bool = False) -> bytes:
        key = (choice.index, choice.first_chunk, reasoning)
        prefix = self._prefixes.get(key)
        if prefix is None:
            role = b'"role":"assistant",' if choice.first_chunk else b""
            field = b'"reasoning_content":' if reasoning else b'"content":'
            prefix = self._prefixes[key] = self._head + b'%d,"delta":{%b%b' % (choice.index, role, field)
        choice.first_chunk = False
        return prefix + _json.encode(text) + b'},"logprobs":null,"finish_reason":null}]}\n\n'

    def _logprobs(self, token_ids: list[int], entries: list[Logprob]) -> dict[str, Any] | None:
        if self.top_logprobs is None or not token_ids:
            return None
        token_str = self.tokenizer.token_str

        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = token_str(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for tid, entry in zip(token_ids, entries, strict=True):
            if entry is None:
                continue
            content.append(item(tid, entry[0]) | {
                "top_logprobs": [item(t, lp) for t, lp in zip(entry[1], entry[2], strict=True)]})
        return {"content": content}

    def chunk(self, choice: Piece, text: str, token_ids: list[int], logprobs: list[Logprob],
              finish_reason: str | None, abort_reason: str | None, reasoning: str = "") -> bytes:
        if self.tools is not None:
            return self._tool_chunks(choice, text, token_ids, logprobs, finish_reason, abort_reason, reasoning)
        first = choice.first_chunk
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text or (not reasoning and (first or finish_reason is None)):
            delta["content"] = text
        choice.first_chunk = False
        body = {"index": choice.index, "delta": delta, "logprobs": self._logprobs(token_ids, logprobs),
                "finish_reason": finish_reason}
        envelope = self._envelope(_with_abort_reason(body, finish_reason, abort_reason))
        if self.prompt_logprobs is not None and first:
            envelope["prompt_logprobs"] = self._vllm_prompt_logprobs(choice.prompt_logprobs)
        return sse(envelope)

    def _tool_chunks(self, choice: Piece, text: str, token_ids: list[int], logprobs: list[Logprob],
                     finish_reason: str | None, abort_reason: str | None, reasoning: str = "") -> bytes:
        """The chunks a piece of output makes when it may hold calls: its reasoning, its content,
        each call's start (id, type, name) and argument fragments; nothing while a call's header is
        read."""
        parser = self._parsers.setdefault(choice.index, ToolCallParser())
        events = parser.feed(text, final=finish_reason is not None)
        deltas: list[dict[str, Any]] = [{"reasoning_content": reasoning}] if reasoning else []
        if events.content or (choice.first_chunk and finish_reason is None and not events and not deltas):
            deltas.append({"content": events.content})
        for index, call in events.started:
            deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
        for index, fragment in events.arguments:
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
        if finish_reason is not None:
            if parser.calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            deltas.append({})
        out = []
        for i, delta in enumerate(deltas):
            if choice.first_chunk:
                delta = {"role": "assistant"} | delta
                choice.first_chunk = False
            last = finish_reason is not None and i == len(deltas) - 1
            body = {"index": choice.index, "delta": delta,
                    "logprobs": self._logprobs(token_ids, logprobs) if i == 0 else None,
                    "finish_reason": finish_reason if last else None}
            out.append(sse(self._envelope(_with_abort_reason(body, finish_reason if last else None, abort_reason))))
        return b"".join(out)

    def body(self, choices: list[dict[str, Any]], usage: dict[str, object],
             prompt_logprobs: list[PromptLogprob] | None = None) -> dict[str, Any]:
        body = super().body(choices, usage)
        if self.prompt_logprobs is not None:  # vLLM's place for them in a chat answer
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt_logprobs)
        return body

    def answer(self, choice: Piece, text: str, token_ids: list[int], logprobs: list[Logprob],
               finish_reason: str, abort_reason: str | None, reasoning: str | None = None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tools is not None:
            parser = ToolCallParser()
            content = parser.feed(text, final=True).content
            calls = parser.calls or ([c] if (c := parse_llama3_call(text)) is not None else [])
            if calls:
                message = {"role": "assistant", "content": (content.strip() or None) if parser.calls else None,
                           "tool_calls": [{"id": c.id, "type": "function",
                                           "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
                if finish_reason == "stop":
                    finish_reason = "tool_calls"
        if reasoning is not None:
            message["reasoning_content"] = reasoning or None
        body = {"index": choice.index, "message": message,
                "logprobs": self._logprobs(token_ids, logprobs), "finish_reason": finish_reason}
        if self.return_token_ids:
            body.update(token_ids=token_ids, prompt_token_ids=self.prompt_ids)
        return _with_abort_reason(body, finish_reason, abort_reason)
