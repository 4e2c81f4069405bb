"""The Responses API's shapes: the response object, and its stream of typed events.

A stream is OpenAI's sequence of events, each ``event: TYPE`` / ``data: {...}`` with a
``sequence_number`` counted from 0::

    response.created, response.in_progress
    for each output item (a thinking model's reasoning, a message, or a function call):
        response.output_item.added
        reasoning: response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
                   response.content_part.done
        message:   response.content_part.added, response.output_text.delta..., response.output_text.done,
                   response.content_part.done
        call:      response.function_call_arguments.delta..., response.function_call_arguments.done
        response.output_item.done
    response.completed (or response.incomplete, or response.failed)

A split answer's think block (``frontend.reasoning``) is one ``reasoning`` item before the rest,
its text the item's ``reasoning_text`` content (as vLLM gives an open model's raw reasoning; no
summary is written).

The first two go out with the first output (so a request the engine refuses at once still gets a
plain 503, as on the other endpoints). A plain token (no tools to parse) is one prebuilt prefix
and suffix around its text, as chat's plain chunks are. With tools, the output goes through the
same call parser as chat completions; text only opens a message item once it holds more than
whitespace, and whitespace before a call is not the message's.

The renderer keeps the output items as they grow: the last event carries the whole response, and
``finished`` is called with it (the endpoint stores it).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from frontend.render import Piece
from frontend.tool_calls import ToolCall, ToolCallParser, parse_llama3_call
from frontend.tools import ToolUse
from protocol.messages import FinishReason, Logprob, PromptLogprob

_json = msgspec.json.Encoder()


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_object(usage: dict[str, Any]) -> dict[str, Any]:
    """Chat completions' usage (``render.usage_dict``) in the Responses API's names."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    completion = usage.get("completion_tokens_details")
    reasoning = completion.get("reasoning_tokens", 0) if isinstance(completion, dict) else 0
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage["total_tokens"]}


def status_of(finish_reason: str) -> tuple[str, dict[str, str] | None]:
    """A finish reason as the response's ``status`` and ``incomplete_details``."""
    if finish_reason == FinishReason.LENGTH:
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == FinishReason.ABORT:
        return "incomplete", {"reason": "abort"}
    return "completed", None


class ResponsesRenderer:
    """One response's events and object (``frontend.render.Renderer``'s interface; ``n`` is 1)."""

    endpoint = "/v1/responses"
    stream_end = b""  # no ``[DONE]``: the last event says the response is over

    def __init__(self, response_id: str, created: float, model: str, echo: dict[str, Any], tools: ToolUse | None,
                 finished: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.response_id, self.created, self.model = response_id, created, model
        self.echo = echo  # the request's settings the response object repeats (tools, text, ...)
        self.tools = tools if tools is not None and tools.parses else None
        self.plain = self.tools is None
        self.finished = finished
        self.sequence = 0
        self.started = False
        self.items: list[dict[str, Any]] = []  # the output so far
        self._texts: dict[int, list[str]] = {}  # message and reasoning items' text pieces, by output index
        self._message: int | None = None  # the output index of the message item text goes to
        self._reasoning: int | None = None  # the output index of the open reasoning item
        self._thought_head = b""
        self._space = ""  # whitespace held back until text shows it belongs to a message
        self._calls: dict[int, int] = {}  # call index (the parser's) -> output index
        self._parser = ToolCallParser() if self.tools is not None else None
        self._finish_reason: str | None = None
        self._delta_head = b""

    # ------------------------------------------------------------------------------ objects

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 incomplete: dict[str, str] | None = None, error: dict[str, str] | None = None) -> dict[str, Any]:
        return {"id": self.response_id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "error": error, "incomplete_details": incomplete,
                "usage": usage_object(usage) if usage is not None else None, **self.echo}

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json.encode(data) + b"\n\n"

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        shown = self.response("in_progress", [])
        return self._event("response.created", response=shown) + self._event("response.in_progress", response=shown)

    # ------------------------------------------------------------------------------ reasoning items

    def _thought(self, text: str) -> bytes:
        """``text`` into the open reasoning item (opened first when needed)."""
        out = b""
        if self._reasoning is None:
            index = len(self.items)
            item: dict[str, Any] = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                                    "encrypted_content": None, "status": "in_progress"}
            self.items.append(item)
            self._texts[index] = []
            self._reasoning = index
            out = (self._event("response.output_item.added", output_index=index, item=item)
                   + self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                 content_index=0, part={"type": "reasoning_text", "text": ""}))
        index = self._reasoning
        self._texts[index].append(text)
        return out + self._event("response.reasoning_text.delta", item_id=self.items[index]["id"],
                                 output_index=index, content_index=0, delta=text)

    def _close_reasoning(self, status: str) -> bytes:
        index = self._reasoning
        if index is None:
            return b""
        self._reasoning = None
        item = self.items[index]
        part = {"type": "reasoning_text", "text": "".join(self._texts[index])}
        item.update(status=status, content=[part])
        return (self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"])
                + self._event("response.content_part.done", item_id=item["id"], output_index=index,
                              content_index=0, part=part)
                + self._event("response.output_item.done", output_index=index, item=item))

    # ------------------------------------------------------------------------------ message items

    def _open_message(self) -> bytes:
        out = self._close_reasoning("completed")  # the answer begins: the thinking is over
        index = len(self.items)
        item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        self.items.append(item)
        self._texts[index] = []
        self._message = index
        part = {"type": "output_text", "text": "", "annotations": []}
        return out + (self._event("response.output_item.added", output_index=index, item=item)
                + self._event("response.content_part.added", item_id=item["id"], output_index=index,
                              content_index=0, part=part))

    def _text(self, text: str) -> bytes:
        """``text`` into the open message item (opened first when needed)."""
        out = b""
        if self._message is None:
            out = self._open_message()
        index = self._message
        assert index is not None
        self._texts[index].append(text)
        return out + self._event("response.output_text.delta", item_id=self.items[index]["id"], output_index=index,
                                 content_index=0, delta=text, logprobs=[])

    def _close_message(self, status: str) -> bytes:
        index = self._message
        if index is None:
            return b""
        self._message = None
        item = self.items[index]
        text = "".join(self._texts[index])
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item.update(status=status, content=[part])
        return (self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=text, logprobs=[])
                + self._event("response.content_part.done", item_id=item["id"], output_index=index,
                              content_index=0, part=part)
                + self._event("response.output_item.done", output_index=index, item=item))

    # ------------------------------------------------------------------------------ streaming

    def token(self, choice: Piece, text: str, reasoning: bool = False) -> bytes:
        """A plain token: one delta event, its prefix made once (after the item's first events).
        A token that adds no text yet (part of a character) makes no event."""
        if not text:
            return self._start()
        if reasoning:
            return self._thought_token(choice, text)
        if not self._delta_head:
            out = self._start() + self._text(text)
            index = self._message
            assert index is not None
            self._delta_head = (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
                                b'"item_id":' + _json.encode(self.items[index]["id"])
                                + b',"output_index":%d,"content_index":0,"logprobs":[],"sequence_number":' % index)
            choice.first_chunk = False
            return out
        assert self._message is not None
        self._texts[self._message].append(text)
        sequence = self.sequence
        self.sequence += 1
        return self._delta_head + b'%d,"delta":' % sequence + _json.encode(text) + b"}\n\n"

    def _thought_token(self, choice: Piece, text: str) -> bytes:
        if not self._thought_head:
            out = self._start() + self._thought(text)
            index = self._reasoning
            assert index is not None
            self._thought_head = (b'event: response.reasoning_text.delta\ndata: {"type":"response.reasoning_text.delta",'
                                  b'"item_id":' + _json.encode(self.items[index]["id"])
                                  + b',"output_index":%d,"content_index":0,"sequence_number":' % index)
            choice.first_chunk = False
            return out
        # The reasoning comes before any other text, so its item is still the open one.
        assert self._reasoning is not None
        self._texts[self._reasoning].append(text)
        sequence = self.sequence
        self.sequence += 1
        return self._thought_head + b'%d,"delta":' % sequence + _json.encode(text) + b"}\n\n"

    def chunk(self, choice: Piece, text: str, token_ids: list[int], logprobs: list[Logprob],
              finish_reason: str | None, abort_reason: str | None, reasoning: str = "") -> bytes:
        choice.first_chunk = False
        out = self._start()
        if reasoning:
            out += self._thought_token(choice, reasoning) if self._thought_head else self._thought(reasoning)
        if self._parser is None:
            if text:
                out += self.token(choice, text) if self._delta_head else self._text(text)
        else:
            out += self._tool_events(text, final=finish_reason is not None)
        if finish_reason is not None:
            self._finish_reason = finish_reason
            status = status_of(finish_reason)[0]
            # A block cut by the end of the output is as complete as the response.
            out += self._close_reasoning(status)
            if self._message is None and not self.items:
                out += self._open_message()  # an empty answer is still one message, as OpenAI's
            out += self._close_message(status) + self._close_calls(status)
        return out

    def _tool_events(self, text: str, final: bool) -> bytes:
        assert self._parser is not None
        events = self._parser.feed(text, final=final)
        out = b""
        # Whitespace at the end of the text so far is held back: it is the message's only if
        # more text follows (a call's surrounding newlines make no message, or no message's end).
        content = self._space + events.content
        body = content.rstrip()
        self._space = content[len(body):]
        if body:
            out += self._text(body)
        if final and not self._parser.calls and self._space and self._message is not None:
            out += self._text(self._space)
        for index, call in events.started:
            self._space = ""
            out += self._close_reasoning("completed") + self._close_message("completed")
            output_index = len(self.items)
            self._calls[index] = output_index
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call.id,
                    "name": call.name, "arguments": ""}
            self.items.append(item)
            out += self._event("response.output_item.added", output_index=output_index, item=item)
        for index, fragment in events.arguments:
            output_index = self._calls[index]
            item = self.items[output_index]
            item["arguments"] += fragment
            out += self._event("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=output_index, delta=fragment)
        return out

    def _close_calls(self, status: str) -> bytes:
        out = b""
        assert self._parser is not None or not self._calls
        for index, output_index in self._calls.items():
            call = self._parser.calls[index] if self._parser is not None else None
            item = self.items[output_index]
            if call is not None:
                item["arguments"] = call.arguments
            item["status"] = "completed" if call is not None and call.complete else "incomplete"
            out += (self._event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=output_index, name=item["name"], arguments=item["arguments"])
                    + self._event("response.output_item.done", output_index=output_index, item=item))
        self._calls = {}
        return out

    def usage_chunk(self, usage: dict[str, object]) -> bytes:
        """The stream's last event: the whole response (called once every output is complete)."""
        status, incomplete = status_of(self._finish_reason or FinishReason.STOP)
        response = self.response(status, self.items, usage, incomplete)
        if status == "completed":
            response["completed_at"] = time.time()
        if self.finished is not None:
            self.finished(response)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return self._event(kind, response=response)

    def error(self, message: str, code: str) -> bytes:
        """The response failed after its stream began: ``response.failed`` with the error."""
        failed = self.response("failed", self.items, error={"code": code, "message": message})
        return self._start() + self._event("response.failed", response=failed)

    # ------------------------------------------------------------------------------ whole answers

    def answer(self, choice: Piece, text: str, token_ids: list[int], logprobs: list[Logprob],
               finish_reason: str, abort_reason: str | None, reasoning: str | None = None) -> dict[str, Any]:
        status = status_of(finish_reason)[0]
        calls: list[ToolCall] = []
        if self.tools is not None:
            parser = ToolCallParser()
            content = parser.feed(text, final=True).content
            calls = parser.calls or ([c] if (c := parse_llama3_call(text)) is not None else [])
            text = (content.strip() if parser.calls else "") if calls else content
        output: list[dict[str, Any]] = []
        if reasoning:  # as a stream has it: complete once the answer began, else as the response is
            output.append({"id": new_id("rs"), "type": "reasoning", "summary": [],
                           "content": [{"type": "reasoning_text", "text": reasoning}], "encrypted_content": None,
                           "status": "completed" if text or calls else status})
        if text or not (calls or reasoning):
            output.append({"id": new_id("msg"), "type": "message", "role": "assistant", "status": status,
                           "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
        output += [{"id": new_id("fc"), "type": "function_call", "status": "completed" if c.complete else "incomplete",
                    "call_id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]
        return {"output": output, "finish_reason": finish_reason}

    def body(self, choices: list[dict[str, Any]], usage: dict[str, object],
             prompt_logprobs: list[PromptLogprob] | None = None) -> dict[str, Any]:
        (only,) = choices
        status, incomplete = status_of(only["finish_reason"])
        response = self.response(status, only["output"], usage, incomplete)
        if status == "completed":
            response["completed_at"] = time.time()
        if self.finished is not None:
            self.finished(response)
        return response
