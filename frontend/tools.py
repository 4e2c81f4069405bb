"""Tool calling: OpenAI's ``tools`` / ``tool_choice`` on chat completions.

The model writes its calls in the Hermes form that Qwen2 and the SmolLM2 family were trained on,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

or, for Llama 3.x, the whole answer as one JSON object ``{"name": ..., "parameters": ...}``.

* ``tool_choice`` ``"required"`` or a named function: the output is held to a grammar of such
  calls (one, or several with ``parallel_tool_calls``), each call's JSON to its tool's
  ``parameters`` schema — the model cannot answer otherwise;
* ``"auto"`` (the default when tools are given): the model chooses; its calls are parsed out of
  its text, and text that is not a call stays ``content``;
* ``"none"``: no tools are shown to the model and nothing is parsed.

The chat template receives ``tools`` when it knows them (its source mentions ``tools``), as
``transformers``' ``apply_chat_template(tools=...)`` passes them; a template that does not (the
built-in SmolLM2's) gets ``DEFAULT_TOOL_PROMPT`` in the system message instead. Earlier turns
are rendered back: an assistant message's ``tool_calls`` (their arguments parsed, as templates
expect them) and ``tool`` messages with their results.

``ToolCallParser`` reads the output as it streams: text outside calls goes out as content at
once; a call goes out as OpenAI's ``delta.tool_calls`` — its id, type and name first, then its
arguments in fragments as they arrive.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from frontend.errors import bad_request
from frontend.structured import Constraint, compact

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
DEFAULT_TOOL_PROMPT = (
    "You can call functions to help with the user's request. Their signatures, as JSON, are inside "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call one, answer with its name and arguments as a JSON object inside <tool_call></tool_call>, "
    "one call per tag:\n<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}\n"
    "</tool_call>"
)


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and what it asks of them."""

    tools: list[dict[str, Any]]  # OpenAI's shape: {"type": "function", "function": {...}}
    choice: str  # "none", "auto", "required", or "named"
    named: str | None = None  # the function a named choice requires
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return dict(tool["function"].get("parameters") or {"type": "object"})
        raise KeyError(name)


def tool_use(tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolUse | None:
    """The request's tools, checked (a 400 naming the field); None without tools or calls."""
    checked: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}', where)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'",
                              f"{where}.function.name")
        if name in seen:
            raise bad_request(f"{where}.function.name: the tool {name!r} is named twice", f"{where}.function.name")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema (an object)",
                              f"{where}.function.parameters")
        checked.append({"type": "function", "function": {k: v for k, v in fn.items()
                                                          if k in ("name", "description", "parameters", "strict")}})
    named = None
    if tool_choice is None:
        choice = "auto" if checked else "none"
    elif tool_choice in ("none", "auto", "required"):
        choice = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict) and isinstance(tool_choice["function"].get("name"), str):
        choice, named = "named", tool_choice["function"]["name"]
        if named not in seen:
            raise bad_request(f"tool_choice names {named!r}, which is not in tools", "tool_choice")
    else:
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                          '{"name": ...}}', "tool_choice")
    if choice in ("required", "named") and not checked:
        raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
    if not checked:
        return None
    return ToolUse(checked, choice, named, parallel is not False)


def calls_constraint(use: ToolUse | None) -> Constraint | None:
    """The constraint that holds a required or named choice's output to calls of its tools (a
    Lark grammar, llguidance's, with ``%json`` for each call's body); None when the model chooses."""
    grammar = None if use is None else calls_grammar(use)
    return None if grammar is None else Constraint("tool_choice", grammar)


def calls_grammar(use: ToolUse) -> str | None:
    if use.choice not in ("required", "named"):
        return None
    names = [use.named] if use.named is not None else [t["function"]["name"] for t in use.tools]
    bodies = [{"type": "object", "properties": {"name": {"const": n}, "arguments": use.parameters(n)},
               "required": ["name", "arguments"], "additionalProperties": False} for n in names]
    # Written as json.dumps writes it, as the model saw calls written in its prompt.
    schema = compact(bodies[0] if len(bodies) == 1 else {"anyOf": bodies})
    # After a call the output may end; with parallel calls, a newline may begin the next one.
    more = ' ("\\n" call)*' if use.parallel and use.named is None else ""
    return (f"start: call{more}\n"
            f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
            f"body: %json {json.dumps(schema)}\n")


def prompt_messages(messages: list[dict[str, Any]], use: ToolUse | None, knows_tools: bool) -> list[dict[str, Any]]:
    """The conversation as the chat template renders it. For a template that knows tools, the
    assistant turns' calls with their arguments parsed (as templates expect); for one that does
    not, calls and results written as the model reads them, and the tools in the system message."""
    if knows_tools:
        return [_with_parsed_arguments(m) for m in messages]
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            written = "\n".join(f'{OPEN}\n{json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)})}'
                                f"\n{CLOSE}" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + written).strip()})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if use is not None and use.choice != "none":
        prompt = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in use.tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{prompt}".strip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _arguments(call: dict[str, Any]) -> Any:
    args = call.get("function", {}).get("arguments", "{}")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def _with_parsed_arguments(m: dict[str, Any]) -> dict[str, Any]:
    if not m.get("tool_calls"):
        return m
    calls = [{**c, "function": {**c["function"], "arguments": _arguments(c)}} for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


# ------------------------------------------------------------------------------------ parsing


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolEvents:
    """What a piece of output meant: content text, calls begun (index, call), argument fragments."""

    content: str = ""
    started: list[tuple[int, ToolCall]] = field(default_factory=list)
    arguments: list[tuple[int, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.started or self.arguments)


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class ToolCallParser:
    """Splits a streamed output into content and tool calls (see the module docstring).

    A call's header (``{"name": ..., "arguments": ``) is read first; its arguments object is then
    passed on as it arrives, its JSON depth followed so the object's end is known. A call written
    otherwise (arguments first) is read whole at ``</tool_call>``."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._text = ""  # unread output
        self._state = "text"  # text | head | args | tail
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, delta: str, final: bool = False) -> ToolEvents:
        self._text += delta
        events = ToolEvents()
        while self._step(events, final):
            pass
        if final:
            self._finish(events)
        return events

    def _step(self, events: ToolEvents, final: bool) -> bool:
        text = self._text
        if self._state == "text":
            if self.calls:  # the whitespace between and after calls is not content
                text = self._text = text.lstrip()
            at = text.find(OPEN)
            if at == -1:
                keep = 0 if final else _partial_suffix(text, OPEN)
                events.content += text[: len(text) - keep]
                self._text = text[len(text) - keep :]
                return False
            events.content += text[:at]
            self._text, self._state = text[at + len(OPEN) :], "head"
            return True
        if self._state == "head":
            head = _HEAD.match(text)
            if head is None:
                if CLOSE in text:  # not the usual order: read whole
                    body, _, rest = text.partition(CLOSE)
                    self._whole_call(body, events)
                    self._text, self._state = rest, "text"
                    return True
                return False
            call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", json.loads(f'"{head.group(1)}"'))
            self.calls.append(call)
            events.started.append((len(self.calls) - 1, call))
            self._text, self._state = text[head.end() :], "args"
            self._depth, self._in_string, self._escaped = 0, False, False
            return True
        if self._state == "args":
            if not self.calls[-1].arguments:  # the space before the object is not an argument
                text = self._text = text.lstrip()
            end = self._scan_arguments(text)
            piece = text if end is None else text[:end]
            if piece:
                self.calls[-1].arguments += piece
                events.arguments.append((len(self.calls) - 1, piece))
            self._text = "" if end is None else text[end:]
            if end is None:
                return False
            self._state = "tail"
            return True
        # tail: after the arguments, up to and including </tool_call>
        at = text.find(CLOSE)
        if at == -1:
            self._text = text[-len(CLOSE) :] if not final else ""
            return False
        self._text, self._state = text[at + len(CLOSE) :].lstrip("\n"), "text"
        return True

    def _scan_arguments(self, text: str) -> int | None:
        """Where the arguments object ends in ``text`` (just past its closing brace), following
        depth and strings across calls; None if it does not end here."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None

    def _whole_call(self, body: str, events: ToolEvents) -> None:
        try:
            obj = json.loads(body)
        except ValueError:
            events.content += f"{OPEN}{body}{CLOSE}"  # not a call after all: the model's text
            return
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            events.content += f"{OPEN}{body}{CLOSE}"
            return
        args = obj.get("arguments", obj.get("parameters", {}))
        call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(args))
        self.calls.append(call)
        events.started.append((len(self.calls) - 1, call))
        events.arguments.append((len(self.calls) - 1, call.arguments))

    def _finish(self, events: ToolEvents) -> None:
        """The output ended: whatever is left unread is content (an unfinished call as written)."""
        if self._state == "text":
            events.content += self._text
        elif self._state == "head":
            events.content += OPEN + self._text
        self._text = ""


def parse_llama3_call(text: str) -> ToolCall | None:
    """Llama 3.x's form: the whole answer one JSON object with a name and parameters."""
    stripped = text.strip().removeprefix("<|python_tag|>")
    if not stripped.startswith("{"):
        return None
    try:
        obj = json.loads(stripped)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not (
            "parameters" in obj or "arguments" in obj):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"],
                    json.dumps(obj.get("parameters", obj.get("arguments", {}))))


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker`` (held back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
