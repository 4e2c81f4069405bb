"""A Responses API request, read: its body, and its ``input`` items as the chat messages, tools
and structured-output format that chat completions already serve.

OpenAI's Responses API says the same things as chat completions in other shapes: ``input`` is a
string or a list of items (messages with content parts, the model's earlier ``function_call``
items, the client's ``function_call_output`` items), tools are flat (``{"type": "function",
"name": ...}``) and the output format is ``text.format``. Each is translated here, once, and
whatever Sluice cannot act on is refused with a 400 naming the field: built-in tools (web search,
file search, computer use, ...), ``background``, images and files in input. A thinking model's
earlier ``reasoning`` items go back to the template as the next assistant turn's
``reasoning_content``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from frontend.errors import bad_request
from frontend.schemas import MAX_USER_CHARS, PositiveInt, Priority, Seed, Temperature, TopP

MAX_ITEMS = 2048  # input items of one request
MAX_METADATA = 16  # keys, as OpenAI allows
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/responses``. Fields OpenAI defines that would change nothing here are accepted
    (``service_tier``, ``prompt_cache_key``, ``safety_identifier``, ``stream_options``);
    fields for features Sluice lacks are accepted only unset (``check_unsupported``)."""

    model: str | None = None
    input: str | Annotated[list[Any], Meta(max_length=MAX_ITEMS)]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    metadata: Annotated[dict[str, str], Meta(max_length=MAX_METADATA)] | None = None
    user: Annotated[str, Meta(max_length=MAX_USER_CHARS)] | None = None
    store: bool = True
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Its effort is read by ``reasoning_effort``: a model that does not think takes none only.
    reasoning: dict[str, Any] | None = None
    # Features Sluice does not have: refused when set (``check_unsupported``).
    background: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt: Any = None
    conversation: Any = None
    # Sluice's (and vLLM's) extensions, as on the other endpoints.
    priority: Priority = 0
    seed: Seed | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None


def check_unsupported(body: ResponsesRequest) -> None:
    """A 400 naming the first field that asks for what Sluice cannot do."""
    if body.background:
        raise bad_request("background responses are not supported; use stream or wait for the response",
                          "background")
    if body.include:
        raise bad_request(f"include is not supported (asked for {', '.join(map(str, body.include))})", "include")
    if body.top_logprobs:
        raise bad_request("top_logprobs is not supported on /v1/responses; chat completions return logprobs",
                          "top_logprobs")
    if body.max_tool_calls is not None:
        raise bad_request("max_tool_calls is not supported", "max_tool_calls")
    if body.prompt is not None:
        raise bad_request("prompt (a stored prompt template) is not supported; send instructions and input",
                          "prompt")
    if body.conversation is not None:
        raise bad_request("conversation is not supported; continue with previous_response_id", "conversation")
    if body.truncation not in (None, "disabled"):
        raise bad_request('truncation "auto" is not supported: a conversation longer than the context is a 400',
                          "truncation")


REASONING_KEYS = ("effort", "summary", "generate_summary")


def reasoning_effort(reasoning: dict[str, Any] | None) -> str | None:
    """``reasoning.effort`` (``openai_api.thinking_kwargs`` says what it does). ``summary`` is
    accepted and writes none: a reasoning item carries the think block's own text, as its
    ``content``."""
    for key in reasoning or {}:
        if key not in REASONING_KEYS:
            raise bad_request(f"reasoning.{key} is not supported ({', '.join(REASONING_KEYS)} are)",
                              f"reasoning.{key}")
    effort = (reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad_request("reasoning.effort must be a string", "reasoning.effort")
    return effort


# ------------------------------------------------------------------------------------ tools


def chat_tools(tools: list[Any] | None) -> list[Any] | None:
    """Responses' flat function tools in chat completions' shape; other tool types refused."""
    if tools is None:
        return None
    out: list[Any] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad_request(f'tools[{i}] must be {{"type": "function", "name": ...}}', f"tools[{i}]")
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(f"tools[{i}]: tools of type {kind!r} are not supported; only function tools are",
                              f"tools[{i}].type")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def chat_tool_choice(choice: Any, tools: list[Any] | None) -> tuple[list[Any] | None, Any]:
    """``tool_choice`` in chat completions' shape, with the tools it leaves the model: the
    strings as they are, a named function ``{"type": "function", "name": N}`` as ``{"type":
    "function", "function": {"name": N}}``, and ``{"type": "allowed_tools", "mode": M, "tools":
    [...]}`` as choice M over the function tools it lists (what pydantic-ai sends to narrow the
    tools of one step)."""
    if choice is None or isinstance(choice, str):
        return tools, choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return tools, {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools" and isinstance(choice.get("tools"), list):
        allowed = {t.get("name") for t in choice["tools"] if isinstance(t, dict) and t.get("type") == "function"}
        if len(allowed) != len(choice["tools"]):
            raise bad_request("tool_choice.tools may list function tools only", "tool_choice.tools")
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise bad_request(f'tool_choice.mode must be "auto" or "required", got {mode!r}', "tool_choice.mode")
        kept = [t for t in tools or [] if t["function"]["name"] in allowed]
        missing = allowed - {t["function"]["name"] for t in kept}
        if missing:
            raise bad_request(f"tool_choice allows {sorted(map(str, missing))[0]!r}, which is not in tools", "tool_choice.tools")
        return kept, mode
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise bad_request(f"tool_choice {kind or choice!r} is not supported: use none, auto, required or "
                      '{"type": "function", "name": ...}', "tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat completions' ``response_format`` (the structured-output engine)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        if "schema" not in schema:
            raise bad_request("text.format json_schema needs a schema", "text.format.schema")
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(f"text.format type {kind!r} is not supported: text, json_object or json_schema",
                      "text.format.type")


# ------------------------------------------------------------------------------------ input


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS and isinstance(part.get("text"), str):
        return str(part["text"])
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return str(part["refusal"])
    if kind in ("input_image", "input_file", "input_audio"):
        raise bad_request(f"{where}: {kind} is not supported; this server serves a text model", f"{where}.type")
    raise bad_request(f"{where} must be a text part ({', '.join(TEXT_PARTS)}) with its text", where)


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    return "".join(_part_text(part, f"{where}[{j}]") for j, part in enumerate(content))


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its ``reasoning_text`` content, else its summaries."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if isinstance(parts, list):
            text = "".join(p["text"] for p in parts if isinstance(p, dict) and p.get("type") == kind
                           and isinstance(p.get("text"), str))
            if text:
                return text
    return ""


def input_messages(items: str | list[Any], history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """``input`` as chat messages, after ``history`` (a stored conversation it continues):
    messages as they are; an earlier ``function_call`` as an assistant's tool call (calls in a
    row are one assistant turn, joined to the assistant's text before them); a
    ``function_call_output`` as a tool message answering a call made before it; a ``reasoning``
    item's text as the ``reasoning_content`` of the assistant turn after it."""
    messages = [dict(m) for m in history or []]
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not items:
        raise bad_request("input is empty", "input")
    calls = {c["id"] for m in messages for c in m.get("tool_calls") or []}
    thought = ""  # a reasoning item's text, for the next assistant turn
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object (a message or a function_call / function_call_output)",
                              where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise bad_request(f"{where}.role must be one of {', '.join(INPUT_ROLES)}; got {role!r}",
                                  f"{where}.role")
            messages.append({"role": role, "content": _content_text(item.get("content"), f"{where}.content")})
            if role == "assistant" and thought:
                messages[-1]["reasoning_content"], thought = thought, ""
        elif kind == "reasoning":
            thought += _reasoning_text(item)
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            for field, value in (("call_id", call_id), ("name", name), ("arguments", arguments)):
                if not isinstance(value, str) or (field != "arguments" and not value):
                    raise bad_request(f"{where}: a function_call needs {field} (a string)", f"{where}.{field}")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*(last.get("tool_calls") or []), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if thought:
                messages[-1]["reasoning_content"] = messages[-1].get("reasoning_content", "") + thought
                thought = ""
            calls.add(call_id)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{where}: a function_call_output needs the call_id of the call it answers",
                                  f"{where}.call_id")
            if call_id not in calls:
                raise bad_request(f"{where}.call_id {call_id!r} answers no function_call before it (in input, or "
                                  "in the response previous_response_id continues)", f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _content_text(item.get("output"), f"{where}.output")})
        elif kind is None:
            raise bad_request(f"{where} has neither a type nor a role", where)
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported (messages, function_call "
                              "and function_call_output are)", f"{where}.type")
    return messages


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's ``output`` items as the assistant turn they were: its reasoning, its
    text and its calls, in one message."""
    text = "".join(part.get("text", "") for item in output if item.get("type") == "message"
                   for part in item.get("content") or [] if part.get("type") == "output_text")
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item.get("type") == "function_call"]
    thought = "".join(_reasoning_text(item) for item in output if item.get("type") == "reasoning")
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    if thought:
        message["reasoning_content"] = thought
    return [message] if text or calls or thought else []
