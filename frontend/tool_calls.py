"""Reading tool calls out of a model's text as it streams (``tool_choice`` auto, and the reply).

The model writes its calls in the Hermes form Qwen2 and the SmolLM2 family were trained on,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, or (Llama 3.x) the whole answer as
one ``{"name": ..., "parameters": ...}`` object (``parse_llama3_call``). ``ToolCallParser`` reads
the output as it streams: text outside calls goes out as content at once; a call goes out as its
id, type and name first, then its arguments in fragments as they arrive (arguments the model
wrote as a JSON string go in one piece once the string closes: the JSON it holds).

The parser reads whatever the model writes, and one choice's text must never take the output
path down: nothing here raises on any text, and what it makes of a text does not depend on how
the text was cut into pieces (each decision waits for the characters it needs, no more).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""
    # False while the call's arguments are still being read: a call the output cut off keeps
    # False, and its arguments as far as they got (not JSON, so not mistaken for a whole call).
    complete: bool = True


@dataclass
class ToolEvents:
    """What a piece of output meant: content text, calls begun (index, call), argument fragments."""

    content: str = ""
    started: list[tuple[int, ToolCall]] = field(default_factory=list)
    arguments: list[tuple[int, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.started or self.arguments)


class ToolCallParser:
    """Splits a streamed output into content and tool calls (see the module docstring).

    After ``<tool_call>`` the call's header (``{"name": ..., "arguments":``) is read first; its
    arguments are then passed on as they arrive (see ``_Arguments``), and the rest of the call up
    to ``</tool_call>`` is skipped. A call written otherwise (arguments first) is read whole at
    ``</tool_call>``; text after ``<tool_call>`` that does not begin with ``{`` is not a call and
    stays content, as does a call that is not JSON. A ``<tool_call>`` before a call's
    ``</tool_call>`` ends it and begins the next. Whitespace right after a call is not content.

    When the output ends, an unfinished header stays content, as written; a call whose arguments
    were cut off is kept with ``complete`` False and its arguments as far as they got. Those are
    not completed into JSON on purpose: a cut-off call (``finish_reason`` "length") must not
    look runnable, and a truncated argument, such as a path, may mean something else entirely."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._text = ""  # unread output
        self._state = "text"  # text | head | whole | arguments | tail
        self._after_call = False  # the whitespace after a call is not content
        self._searched = 0  # how far a call read whole was searched for its tag
        self._arguments = _Arguments()

    def feed(self, delta: str, final: bool = False) -> ToolEvents:
        self._text += delta
        events = ToolEvents()
        while self._step(events, final):
            pass
        if final:
            self._finish(events)
        return events

    def _step(self, events: ToolEvents, final: bool) -> bool:
        """Reads what it can of the unread text; False when it needs more (or the output ended)."""
        text = self._text
        if self._state == "text":
            if self._after_call:
                text = self._text = text.lstrip()
                self._after_call = not text
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
            verdict, end, raw_name = _read_head(text)
            tag, at = _next_tag(text)
            if verdict == "call" and (at == -1 or end <= at):
                self._start(ToolCall(_call_id(), _name(raw_name), complete=False), events)
                self._text, self._state, self._arguments = text[end:], "arguments", _Arguments()
                return True
            if verdict == "text":  # "<tool_call>" in prose, not a call
                events.content += OPEN
                self._state, self._after_call = "text", False
                return True
            if verdict == "more" and at == -1:
                return False
            self._state, self._searched = "whole", 0  # another shape, or a tag before the header ended
            return True
        if self._state == "whole":
            tag, at = _next_tag(text, self._searched)
            if at == -1:
                self._searched = max(0, len(text) - len(CLOSE) + 1)  # a tag may be split
                return False
            call = _whole_call(text[:at])
            if call is None:  # not a call after all: the model's text
                events.content += OPEN + text[:at] + (tag if tag == CLOSE else "")
            else:
                self._start(call, events)
                events.arguments.append((len(self.calls) - 1, call.arguments))
            self._after_call = call is not None
            self._text, self._state = text[at + len(tag) :], "text" if tag == CLOSE else "head"
            return True
        if self._state == "arguments":
            call = self.calls[-1]
            stop = self._arguments.feed(text)
            piece = self._arguments.take()
            if piece:
                call.arguments += piece
                events.arguments.append((len(self.calls) - 1, piece))
            if stop is None:
                self._text = ""
                return False
            call.complete = True
            self._text, self._state = text[stop:], "tail"
            return True
        # tail: the rest of the call (its closing brace, any other keys), skipped up to its tag
        tag, at = _next_tag(text)
        if at == -1:
            self._text = text[-(len(CLOSE) - 1) :] if not final else ""  # a tag may be split
            return False
        self._text, self._state = text[at + len(tag) :], "text" if tag == CLOSE else "head"
        self._after_call = True
        return True

    def _start(self, call: ToolCall, events: ToolEvents) -> None:
        self.calls.append(call)
        events.started.append((len(self.calls) - 1, call))

    def _finish(self, events: ToolEvents) -> None:
        """The output ended: an unfinished header is content, as written (see the class docstring)."""
        if self._state in ("head", "whole"):
            events.content += OPEN + self._text
        self._text, self._state = "", "text"


_WS = " \t\r\n"  # JSON's whitespace
_NAME_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"', re.S)
_HEADER = ("{", '"name"', ":", "string", ",", ('"arguments"', '"parameters"'), ":")
_HEADER_MAX = 512  # characters: a header still undecided past them is read as a call written whole


def _read_head(text: str) -> tuple[str, int, str]:
    """How the text after ``<tool_call>`` begins: ``("call", end, raw name)`` for a call's header
    (``end`` just past the colon before the arguments); ``"text"`` when it cannot be a call (its
    first character is not ``{``); ``"other"`` for an object of another shape; ``"more"`` while
    the text so far may still become a header. Decided from the fewest characters that can, so
    that a text cut anywhere is read alike, and within the first ``_HEADER_MAX``, so that the
    text read again at each piece stays short (a model may write newlines without end)."""
    window = text[:_HEADER_MAX]
    undecided = ("more" if len(window) < _HEADER_MAX else "other"), 0, ""
    i, name = 0, ""
    for part in _HEADER:
        while i < len(window) and window[i] in _WS:
            i += 1
        if i == len(window):
            return undecided
        if part == "string":
            string = _NAME_STRING.match(window, i)
            if string is None:
                return undecided if window[i] == '"' else ("other", 0, "")
            name, i = string.group(1), string.end()
            continue
        options = (part,) if isinstance(part, str) else part
        matched = next((o for o in options if window.startswith(o, i)), None)
        if matched is None:
            if any(o.startswith(window[i:]) for o in options):
                return undecided
            return ("text" if part == "{" else "other"), 0, ""
        i += len(matched)
    return "call", i, name


def _next_tag(text: str, start: int = 0) -> tuple[str, int]:
    """The first ``<tool_call>`` or ``</tool_call>`` in ``text`` from ``start`` and where it is;
    ("", -1) if none."""
    opens, closes = text.find(OPEN, start), text.find(CLOSE, start)
    if closes != -1 and (opens == -1 or closes < opens):
        return CLOSE, closes
    return (OPEN, opens) if opens != -1 else ("", -1)


_ESCAPE = re.compile(r'\\(u[0-9a-fA-F]{4}|["\\/bfnrt])|\\(.?)', re.S)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _name(raw: str) -> str:
    """A call's name from its JSON string as written. An escape JSON does not have is read as the
    character after the backslash: a backslash cannot be part of a tool's name, and models put
    one there from Markdown's habit (``get\\_weather`` is ``get_weather``). A lone surrogate
    (``\\ud800``) becomes U+FFFD, as UTF-8 cannot carry it to the client."""
    valid = _ESCAPE.sub(lambda m: m.group(0) if m.group(1) else m.group(2), raw)
    # Cannot fail: every backslash now begins an escape JSON has, and a raw name holds no bare quote.
    return _SURROGATE.sub("\ufffd", json.loads(f'"{valid}"', strict=False))


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _load(text: str) -> Any:
    """JSON as its standard has it: ValueError for anything else, NaN and Infinity included
    (json.loads takes them, but no other reader does), and for nesting too deep for Python."""
    try:
        return json.loads(text, parse_constant=_not_json)
    except RecursionError as e:
        raise ValueError("nested too deeply") from e


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _dump(value: Any) -> str | None:
    """``value`` as JSON text; None if it has none (a number too large for a float, like 1e999)."""
    try:
        return json.dumps(value, allow_nan=False)
    except (ValueError, RecursionError):
        return None


def _string_arguments(value: str) -> str:
    """Arguments the model wrote as a JSON string: the JSON it holds, as json.dumps writes it, or,
    holding none, the string itself (so that the arguments are JSON either way)."""
    try:
        held = _dump(_load(value))
    except ValueError:
        held = None
    return held if held is not None else json.dumps(value)


def _whole_call(body: str) -> ToolCall | None:
    """A call written whole (its keys in any order), or None if ``body`` is not one."""
    try:
        obj = _load(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = _string_arguments(args) if isinstance(args, str) else _dump(args)
    if arguments is None:
        return None
    return ToolCall(_call_id(), _SURROGATE.sub("\ufffd", obj["name"]), arguments)


_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')  # a run of a string's characters that need no care
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_HEX = "0123456789abcdefABCDEF"
# A JSON number's grammar: state -> {character class: next state}. The number may end (at the
# first character that goes nowhere) in the states of _NUMBER_ENDS.
_NUMBER = {
    "start": {"-": "sign", "0": "zero", "1": "int"},
    "sign": {"0": "zero", "1": "int"},
    "zero": {".": "dot", "e": "e"},
    "int": {"0": "int", "1": "int", ".": "dot", "e": "e"},
    "dot": {"0": "frac", "1": "frac"},
    "frac": {"0": "frac", "1": "frac", "e": "e"},
    "e": {"0": "exp", "1": "exp", "+": "sign_e", "-": "sign_e"},
    "sign_e": {"0": "exp", "1": "exp"},
    "exp": {"0": "exp", "1": "exp"},
}
_NUMBER_ENDS = ("zero", "int", "frac", "exp")


class _Arguments:
    """One call's arguments, a JSON value, read as they stream. Each piece is handed out once it
    is known to belong to valid JSON, so that the pieces joined always parse once the value ends:

    * an object, array, number or literal is passed on as written, except that inside strings a
      raw control character is escaped and an escape JSON does not have (``C:\\Users``'s ``\\U``)
      keeps its backslash as a character (``\\\\U``: nothing the model wrote is lost), and a
      trailing comma is dropped;
    * a string (``"{\\"city\\": \\"Paris\\"}"``, as models often write them) is handed out in one
      piece when it closes: the JSON it holds, as json.dumps writes it (``_string_arguments``);
    * where the text stops being JSON (``{"a": 1 b}``, a ``</tool_call>`` outside any string), the
      value is closed with the least text that makes it JSON (``{"a": 1}``; ``{}`` when there was
      no value at all) and that character is not the arguments'.
    """

    def __init__(self) -> None:
        self._out = ""  # read and checked, not yet handed out
        self._held = ""  # what the next character decides: a comma (and the space after it)
        #                  that may be trailing, or an escape begun in a string
        self._closers: list[str] = []  # the brackets that close the containers open
        self._expect = "value"  # value | first | key | colon | after | string | number | literal
        self._key = False  # the string being read is an object's key
        self._number = ""  # where in a number's grammar
        self._rest = ""  # the rest of a literal (true, false, null)
        self._quoted = False  # the arguments are written as a string
        self.done = False

    def feed(self, text: str) -> int | None:
        """Reads ``text``: where the arguments end in it (the first character not theirs), or None
        if they go on past it."""
        i = 0
        while i < len(text) and not self.done:
            plain = _PLAIN.match(text, i) if self._expect == "string" and not self._held else None
            if plain is not None:
                self._out += plain.group()
                i = plain.end()
            elif self._read(text[i]):
                i += 1
        return i if self.done else None

    def take(self) -> str:
        """The arguments' text read since the last take (a string's only once it closed)."""
        if self._quoted and not self.done:
            return ""
        out, self._out = self._out, ""
        return out

    def _read(self, ch: str) -> bool:
        """Reads one character; False if it is to be read again (in the state it led to) or, once
        done, is not the arguments'."""
        expect = self._expect
        if expect == "string":
            return self._string(ch)
        if expect == "number":
            return self._digit(ch)
        if expect == "literal":
            if ch != self._rest[0]:
                return self._break()
            self._out, self._rest = self._out + ch, self._rest[1:]
            if not self._rest:
                self._ended()
            return True
        if ch in _WS:
            if self._held:
                self._held += ch
            elif self._closers:  # (the space before the value is not the arguments')
                self._out += ch
            return True
        if self._closers and ch == self._closers[-1] and (expect in ("first", "after") or self._held):
            self._held = ""  # a trailing comma is dropped
            self._out += self._closers.pop()
            self._ended()
            return True
        if expect == "after":
            if ch != ",":
                return self._break()
            self._held, self._expect = ",", "key" if self._closers[-1] == "}" else "value"
            return True
        if expect == "first":
            expect = "key" if self._closers[-1] == "}" else "value"
        if expect == "colon" or expect == "key":
            if ch != (":" if expect == "colon" else '"'):
                return self._break()
            self._out += self._held + ch
            self._held, self._key = "", expect == "key"
            self._expect = "value" if expect == "colon" else "string"
            return True
        # a value begins
        if ch not in '{["-0123456789tfn':
            return self._break()
        self._out, self._held = self._out + self._held, ""
        if ch in "{[":
            self._out += ch
            self._closers.append("}" if ch == "{" else "]")
            self._expect = "first"
        elif ch == '"':
            self._out += ch
            self._expect, self._key, self._quoted = "string", False, not self._closers
        elif ch in _LITERALS:
            self._out += ch
            self._expect, self._rest = "literal", _LITERALS[ch]
        else:
            self._expect, self._number = "number", "start"
            return self._digit(ch)
        return True

    def _string(self, ch: str) -> bool:
        if self._held:
            return self._escape(ch)
        if ch == "\\":
            self._held = ch
        elif ch == '"':
            self._out += ch
            if self._key:
                self._expect = "colon"
            else:
                self._ended()
        else:  # a raw control character: _PLAIN passes on the rest
            self._out += json.dumps(ch)[1:-1]
        return True

    def _escape(self, ch: str) -> bool:
        held = self._held
        if held == "\\" and ch in '"\\/bfnrt':
            self._out, self._held = self._out + held + ch, ""
            return True
        if (held == "\\" and ch == "u") or (held.startswith("\\u") and ch in _HEX):
            self._held += ch
            if len(self._held) == 6:
                self._out, self._held = self._out + self._held, ""
            return True
        # Not an escape JSON has: the backslash meant itself (a Windows path's "C:\Users").
        self._out, self._held = self._out + "\\\\" + held[1:], ""
        return False

    def _digit(self, ch: str) -> bool:
        kind = "0" if ch == "0" else "1" if "1" <= ch <= "9" else "e" if ch in "eE" else ch
        following = _NUMBER[self._number].get(kind)
        if following is not None:
            self._out, self._number = self._out + ch, following
            return True
        if self._number in _NUMBER_ENDS:
            self._ended()
            return False
        return self._break()

    def _ended(self) -> None:
        """A value ended; the arguments too if it was not inside another."""
        self._expect = "after"
        if not self._closers:
            self.done = True
            if self._quoted:  # (the string read is JSON: every escape in it was made valid)
                self._out = _string_arguments(json.loads(self._out))

    def _break(self) -> bool:
        """The text stops being JSON here: what was read is closed with the least text that
        makes it JSON, and the character is not the arguments'."""
        expect = self._expect
        if expect == "value" and not self._closers:
            end = "{}"  # no value at all: no arguments
        elif self._held:
            end = ""  # the comma with nothing after it is dropped
        elif expect in ("value", "colon"):
            end = "null" if expect == "value" else ":null"  # the key had no value
        elif expect == "number":
            end = "0"  # "-", "1." or "1e" wanted a digit
        else:
            end = self._rest if expect == "literal" else ""
        self._out += end + "".join(reversed(self._closers))
        self._held, self._closers, self.done = "", [], True
        return False


def parse_llama3_call(text: str) -> ToolCall | None:
    """Llama 3.x's form: the whole answer one JSON object with a name and parameters."""
    stripped = text.strip().removeprefix("<|python_tag|>")
    if not stripped.startswith("{"):
        return None
    try:
        obj = _load(stripped)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not (
            "parameters" in obj or "arguments" in obj):
        return None
    arguments = _dump(obj.get("parameters", obj.get("arguments", {})))
    if arguments is None:
        return None
    return ToolCall(_call_id(), _SURROGATE.sub("\ufffd", obj["name"]), arguments)


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker`` (held back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
