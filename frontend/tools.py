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

Calls in the model's text are read by ``frontend.tool_calls`` (it never raises, whatever the
model writes).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from frontend.errors import bad_request
from frontend.structured import Constraint, closed, compact
from frontend.tool_calls import CLOSE, OPEN

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


def calls_constraint(use: ToolUse | None, tag_ids: Mapping[str, int]) -> Constraint | None:
    """The constraint that holds a required or named choice's output to calls of its tools (a
    Lark grammar, llguidance's, with ``%json`` for each call's body); None when the model chooses.
    ``tag_ids``: the tags the tokenizer writes as one token, by that token's id
    (``ModelTokenizer.tool_tags``)."""
    grammar = None if use is None else calls_grammar(use, tag_ids)
    return None if grammar is None else Constraint("tool_choice", grammar)


def _tag(text: str, tag_ids: Mapping[str, int]) -> str:
    """A tag as the grammar spells it: the token by its id where the tokenizer writes the tag as
    one token, else the string. llguidance counts every added token as special, whatever the
    tokenizer says: a string literal that spells one lets the model pick that token, then refuses
    it (a Qwen tokenizer's ``<tool_call>``: the output ended after one token)."""
    token = tag_ids.get(text)
    return json.dumps(text) if token is None else f"<[{token}]>"


def calls_grammar(use: ToolUse, tag_ids: Mapping[str, int]) -> str | None:
    if use.choice not in ("required", "named"):
        return None
    names = [use.named] if use.named is not None else [t["function"]["name"] for t in use.tools]
    bodies = [{"type": "object", "properties": {"name": {"const": n}, "arguments": use.parameters(n)},
               "required": ["name", "arguments"], "additionalProperties": False} for n in names]
    # Written as json.dumps writes it, as the model saw calls written in its prompt.
    schema = compact(closed(bodies[0] if len(bodies) == 1 else {"anyOf": bodies}))
    # After a call the output may end; with parallel calls, a newline may begin the next one.
    more = ' ("\\n" call)*' if use.parallel and use.named is None else ""
    return (f"start: call{more}\n"
            f'call: {_tag(OPEN, tag_ids)} "\\n" body "\\n" {_tag(CLOSE, tag_ids)}\n'
            f"body: %json {json.dumps(schema)}\n")


def prompt_messages(messages: list[dict[str, Any]], use: ToolUse | None, knows_tools: bool) -> list[dict[str, Any]]:
    """The conversation as the chat template renders it. For a template that knows tools, the
    assistant turns' calls with their arguments parsed (as templates expect); for one that does
    not, calls and results written as the model reads them, and the tools in the system message."""
    if knows_tools:
        return [_with_parsed_arguments(m) for m in messages]
    out: list[dict[str, Any]] = []
    calls: dict[str, dict[str, Any]] = {}  # tool_call_id -> the call its result answers
    for i, m in enumerate(messages):
        answered = i + 1 < len(messages) and messages[i + 1]["role"] == "tool"
        if m["role"] == "assistant" and m.get("tool_calls") and answered:
            calls.update((c.get("id"), c) for c in m["tool_calls"])
            if (m.get("content") or "").strip():
                out.append({"role": "assistant", "content": m["content"]})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            written = "\n".join(f'{OPEN}\n{json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)})}'
                                f"\n{CLOSE}" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + written).strip()})
        elif m["role"] == "tool":
            fact = _result_fact(calls.get(m.get("tool_call_id", "")), m.get("content") or "")
            if out and out[-1]["role"] == "user":
                out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n\n{fact}"}
            else:
                out.append({"role": "user", "content": fact})
        else:
            kept = {"reasoning_content": m["reasoning_content"]} if "reasoning_content" in m else {}
            out.append({"role": m["role"], "content": m.get("content") or ""} | kept)
    if use is not None and use.choice != "none":
        prompt = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in use.tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{prompt}".strip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _result_fact(call: dict[str, Any] | None, result: str) -> str:
    """A tool's result as a line of the user's turn, for a template that knows no tools: the call
    and what it returned (``get_weather({"city": "Paris"}) returned: {...}``). Written as turns of
    their own (the call as the assistant's, the result inside ``<tool_response>`` as the user's),
    small models continue the pattern and parrot the result back instead of answering; with the
    result beside the question they answer it (SmolLM2-135M: 4 of 4 questions against 0 of 4)."""
    if call is None:
        return f"A tool returned: {result}"
    return f"{call['function']['name']}({json.dumps(_arguments(call))}) returned: {result}"


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
