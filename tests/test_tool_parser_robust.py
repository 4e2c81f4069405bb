"""The tool-call parser reads whatever a model writes without raising (issue 37: one choice's
odd text took the other streams of its batch down), and reads a text alike however it was cut:
over arbitrary text rich in the characters calls are made of, and over calls written well
(arguments as an object or as a JSON string, names with Markdown's backslashes)."""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.tool_calls import CLOSE, OPEN, ToolCallParser, parse_llama3_call

Read = tuple[str, list[tuple[str, str, bool]]]  # content, calls (name, arguments, complete)


def _read(pieces: list[str]) -> Read:
    """The pieces streamed through a parser, then the end of the output; checks that the events
    tell what the parser kept (each call started once, in order, before its arguments)."""
    parser = ToolCallParser()
    content, names, arguments = "", [], []
    for piece in [*pieces, None]:
        events = parser.feed(piece or "", final=piece is None)
        content += events.content
        for index, call in events.started:
            assert index == len(names)
            names.append(call.name)
            arguments.append("")
        for index, fragment in events.arguments:
            assert index < len(names) and fragment
            arguments[index] += fragment
    calls = [(c.name, c.arguments, c.complete) for c in parser.calls]
    assert [(n, a) for n, a, _ in calls] == list(zip(names, arguments, strict=True))
    return content, calls


def _cut(text: str, at: list[int]) -> list[str]:
    bounds = [0, *sorted({a % (len(text) + 1) for a in at}), len(text)]
    return [text[a:b] for a, b in pairwise(bounds)]


def _is_json(text: str) -> bool:
    def refuse(constant: str) -> Any:
        raise ValueError(constant)

    try:
        json.loads(text, parse_constant=refuse)
    except ValueError:
        return False
    return True


NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,11}", fullmatch=True)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)


@st.composite
def written_calls(draw: st.DrawFn) -> tuple[str, str, str]:
    """A call as a model writes it, its name, and the arguments the parser should give."""
    name = draw(NAMES)
    args = draw(st.dictionaries(st.text(max_size=6), VALUES, max_size=4))
    comma, colon = draw(st.sampled_from([(", ", ": "), (",", ":")]))
    written_name = json.dumps(name)
    if draw(st.booleans()):
        written_name = written_name.replace("_", "\\_")  # Markdown's habit
    if draw(st.booleans()):  # arguments as a JSON string: read as the JSON it holds
        written, want = json.dumps(json.dumps(args)), json.dumps(args)
    else:  # as an object: passed on as written
        written = want = json.dumps(args, separators=(comma, colon))
    body = f'{{"name"{colon}{written_name}{comma}"arguments"{colon}{written}}}'
    return f"{OPEN}\n{body}\n{CLOSE}", name, want


# Pieces calls are made of, and pieces that break them, in any order.
PIECES = st.sampled_from([
    OPEN, CLOSE, "{", "}", "[", "]", '"', "\\", ":", ",", " ", "\n", "\t", "<", "/", "name", "arguments",
    '"name"', '"arguments"', '"parameters"', "a", "_", "0", "1", "-", ".", "e", "+", "true", "nul", "é", "🙂",
    "\\_", "\\u00e9", "\\u12", "\\ud800", '{"name": "f", "arguments": ', '{"name": "g\\_h", "arguments": "',
    '{"arguments": {}, "name": "k"}'])
TEXTS = st.lists(PIECES | written_calls().map(lambda c: c[0]), max_size=30).map("".join)
PROSE = st.lists(st.sampled_from([*"ab <>/{}\"\\\n:,_\t", "é", "🙂", "tool_call", CLOSE]), max_size=10).map(
    "".join).filter(lambda s: OPEN not in s)
CUTS = st.lists(st.integers(0, 1000), max_size=16)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(text=TEXTS, cuts=CUTS)
def test_any_text_cut_anywhere_reads_as_the_whole_text(text: str, cuts: list[int]) -> None:
    whole = _read([text])
    assert _read(_cut(text, cuts)) == whole
    assert _read(list(text)) == whole
    _, calls = whole
    # A call begins only after the one before it ended; only the last can be cut off.
    assert all(complete for _, _, complete in calls[:-1])
    for name, arguments, complete in calls:
        assert not complete or _is_json(arguments), (name, arguments)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(before=PROSE, calls=st.lists(st.tuples(written_calls(), PROSE), max_size=3), cuts=CUTS)
def test_calls_written_well_are_read_as_written(
        before: str, calls: list[tuple[tuple[str, str, str], str]], cuts: list[int]) -> None:
    text = before + "".join(written + after for (written, _, _), after in calls)
    content, got = _read(_cut(text, cuts))
    assert got == [(name, want, True) for (_, name, want), _ in calls]
    # The whitespace right after a call is not content.
    assert content == before + "".join(after.lstrip() for _, after in calls)


def _call(body: str) -> str:
    return f"{OPEN}\n{body}\n{CLOSE}"


@pytest.mark.parametrize("text, want", [
    # Markdown's backslash in a name (it raised, and took the batch's other streams down).
    (_call(r'{"name": "get\_weather", "arguments": {"city": "Paris"}}'),
     ("", [("get_weather", '{"city": "Paris"}', True)])),
    (_call(r'{"name": "a\\b\u00e9\q", "arguments": {}}'), ("", [("a\\béq", "{}", True)])),
    # Arguments as a JSON string (they never closed: the tag and what followed became arguments).
    (_call(r'{"name": "f", "arguments": "{\"city\": \"Paris\"}"}') + "\nThanks",
     ("Thanks", [("f", '{"city": "Paris"}', True)])),
    (_call('{"name": "f", "arguments": "not json"}'), ("", [("f", '"not json"', True)])),
    (_call('{"arguments": "{\\"x\\": [1]}", "name": "f"}'), ("", [("f", '{"x": [1]}', True)])),
    # Other values: passed on as written, and the call closes.
    (_call('{"name": "f", "arguments": 12.5e-1}') + "x", ("x", [("f", "12.5e-1", True)])),
    (_call('{"name": "f", "parameters": true}') + "x", ("x", [("f", "true", True)])),
    (_call('{"name": "f", "arguments": null}') + "x", ("x", [("f", "null", True)])),
    # The close tag inside a string is the string's.
    (_call('{"name": "f", "arguments": {"html": "</tool_call>"}}') + "x",
     ("x", [("f", '{"html": "</tool_call>"}', True)])),
    # Several calls, the text around them.
    ("Sure. " + _call('{"name": "f", "arguments": {}}') + "\n" + _call('{"name": "g", "arguments": [1]}')
     + "\n\n Done \n", ("Sure. Done \n", [("f", "{}", True), ("g", "[1]", True)])),
    # A new call before the last one's close tag ends it.
    (f'{OPEN}{{"name": "f", "arguments": {{}}}}{OPEN}{{"name": "g", "arguments": {{}}}}{CLOSE}',
     ("", [("f", "{}", True), ("g", "{}", True)])),
    # Cut off by the end of the output: the arguments as far as they got, not complete (not JSON).
    (f'{OPEN}{{"name": "f", "arguments": {{"path": "/tmp/a', ("", [("f", '{"path": "/tmp/a', False)])),
    (f'{OPEN}{{"name": "f", "arguments": "{{\\"a', ("", [("f", "", False)])),
    (f'Hi {OPEN}{{"name": "f", "argu', (f'Hi {OPEN}{{"name": "f", "argu', [])),
    # Not calls: content, as written.
    (f"a {OPEN} b {CLOSE} c", (f"a {OPEN} b {CLOSE} c", [])),
    (f"{OPEN}{{garbage}}{CLOSE} c", (f"{OPEN}{{garbage}}{CLOSE} c", [])),
    (f'{OPEN}{{"name": "f", "arguments": {{}}}}{OPEN} hi', (f"{OPEN} hi", [("f", "{}", True)])),
    (f"{OPEN}{{garbage {OPEN}{{\"name\": \"f\", \"arguments\": {{}}}}{CLOSE}",
     (f"{OPEN}{{garbage ", [("f", "{}", True)])),
    # Unbalanced brackets: closed where the JSON stops; what is left of the call is skipped.
    (_call('{"name": "f", "arguments": {"a": [1, {"b": 2}'), ("", [("f", '{"a": [1, {"b": 2}\n]}', True)])),
    (_call('{"name": "f", "arguments": {"a": 1}}}]}') + "x", ("x", [("f", '{"a": 1}', True)])),
    (_call('{"name": "f", "arguments": }'), ("", [("f", "{}", True)])),
    (_call('{"name": "f", "arguments": {"a": 1 "b": 2}}'), ("", [("f", '{"a": 1 }', True)])),
    (_call('{"name": "f", "arguments": {"a": -}}'), ("", [("f", '{"a": -0}', True)])),
    (_call('{"name": "f", "arguments": {"a" 1}}'), ("", [("f", '{"a" :null}', True)])),
    # Common slips inside arguments: made JSON, keeping what the model meant.
    (_call('{"name": "f", "arguments": {"a": 1, "b": [2,],}}'), ("", [("f", '{"a": 1, "b": [2]}', True)])),
    (_call(r'{"name": "f", "arguments": {"path": "C:\Users\new"}}'),
     ("", [("f", r'{"path": "C:\\Users\new"}', True)])),
    (_call('{"name": "f", "arguments": {"text": "one\ntwo"}}'), ("", [("f", '{"text": "one\\ntwo"}', True)])),
    # A header still undecided after 512 characters is read as a call written whole.
    (OPEN + "\n" * 600 + '{"name": "f", "arguments": {"a":1}}' + CLOSE, ("", [("f", '{"a": 1}', True)])),
    (OPEN + '{"name": "' + "x" * 600, (OPEN + '{"name": "' + "x" * 600, [])),
    # Unicode, and nothing at all.
    (_call('{"name": "météo", "arguments": {"ville": "Zürich 🙂"}}') + "🙂",
     ("🙂", [("météo", '{"ville": "Zürich 🙂"}', True)])),
    ("", ("", [])),
])
def test_model_text_reads_the_same_whole_or_a_character_at_a_time(text: str, want: Read) -> None:
    assert _read([text]) == want
    assert _read(list(text)) == want


def test_arguments_made_json_are_json() -> None:
    # NaN, Infinity and numbers too large for a float: json.loads takes them, no other reader does.
    for written in ('"{\\"a\\": NaN}"', '"{\\"a\\": 1e999}"'):
        _, [(_, arguments, _)] = _read([_call(f'{{"name": "f", "arguments": {written}}}')])
        assert _is_json(arguments) and isinstance(json.loads(arguments), str)
    _, calls = _read([_call('{"arguments": {"a": 1e999}, "name": "f"}')])
    assert calls == []
    # Nesting deeper than Python's recursion limit, as a string, written whole, or Llama 3's form.
    deep = "[" * 5000 + "]" * 5000
    _, [(_, arguments, _)] = _read([_call(f'{{"name": "f", "arguments": {json.dumps(deep)}}}')])
    assert arguments == json.dumps(deep)
    assert _read([_call(f'{{"arguments": {deep}, "name": "f"}}')])[1] == []
    assert parse_llama3_call(f'{{"name": "f", "parameters": {deep}}}') is None
    assert parse_llama3_call('{"name": "f", "parameters": {"a": NaN}}') is None


def test_a_name_carries_no_lone_surrogate() -> None:
    # UTF-8 cannot carry one to the client: the encoder would raise.
    _, [(name, _, _)] = _read([_call(r'{"name": "f\ud800", "arguments": {}}')])
    assert name == "f\ufffd"
    _, [(name, _, _)] = _read([_call(r'{"arguments": {}, "name": "g\udc00"}')])
    assert name == "g\ufffd"
