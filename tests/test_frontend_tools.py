"""Tool calling's parts on their own: a request's tools checked, the grammar a required choice
compiles to (llguidance), the conversation as templates see it (against transformers), and the
streaming call parser, whose output must not depend on how the text was cut into pieces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_frontend_chat_template import _model_dir, _sluice
from tokenizers import AddedToken, Tokenizer

from frontend.errors import APIError
from frontend.output import Output, OutputProcessor
from frontend.render import ChatRenderer
from frontend.tokenizer import IncrementalDetokenizer, ModelTokenizer
from frontend.tool_calls import CLOSE, OPEN, ToolCallParser, parse_llama3_call
from frontend.tools import calls_grammar, prompt_messages, tool_use
from protocol.messages import AddRequest, Finish, ModelInfo, SamplingParams, TokenBatch, pack_logprobs
from worker.model.tiny import build_byte_level_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def _param_of(call: Any) -> str | None:
    with pytest.raises(APIError) as e:
        call()
    return e.value.param


def test_tools_and_tool_choice_are_checked_naming_the_field() -> None:
    assert _param_of(lambda: tool_use([WEATHER, WEATHER], None, None)) == "tools[1].function.name"
    assert _param_of(lambda: tool_use([{"type": "function"}], None, None)) == "tools[0]"
    assert _param_of(lambda: tool_use([{"type": "function", "function": {"name": "a b"}}], None, None)) \
        == "tools[0].function.name"
    assert _param_of(lambda: tool_use([{"type": "function", "function": {"name": "f", "parameters": []}}],
                                      None, None)) == "tools[0].function.parameters"
    assert _param_of(lambda: tool_use([WEATHER], {"type": "function", "function": {"name": "add"}}, None)) \
        == "tool_choice"
    assert _param_of(lambda: tool_use(None, "required", None)) == "tool_choice"
    assert _param_of(lambda: tool_use([WEATHER], "sometimes", None)) == "tool_choice"
    assert tool_use(None, None, None) is None and tool_use([], "none", None) is None
    use = tool_use([WEATHER, ADD], None, None)
    assert use is not None and use.choice == "auto" and use.parallel and use.parses
    named = tool_use([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, False)
    assert named is not None and (named.choice, named.named, named.parallel) == ("named", "add", False)
    none = tool_use([WEATHER], "none", None)
    assert none is not None and not none.parses


def _accepts(grammar: str, text: str) -> bool:
    """Whether ``text`` is a complete output of ``grammar``, byte by byte (a byte-level tokenizer)."""
    tokenizer = build_byte_level_tokenizer(320)
    ll = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=320, eos_token=[2])
    matcher = llguidance.LLMatcher(ll, grammar)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def test_a_required_choice_holds_the_output_to_calls_of_its_tools() -> None:
    required = calls_grammar(tool_use([WEATHER, ADD], "required", None), {})  # type: ignore[arg-type]
    assert required is not None
    one = f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}'
    two = f'{one}\n{OPEN}\n{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}\n{CLOSE}'
    assert _accepts(required, one) and _accepts(required, two)
    assert not _accepts(required, "It is sunny.")
    assert not _accepts(required, one.replace("get_weather", "get_time"))  # not a tool
    assert not _accepts(required, one.replace('"city": "Paris"', '"town": "Paris"'))  # not its schema
    assert not _accepts(required, one.replace('{"city": "Paris"}', '{ "city":"Paris" }'))  # written as json.dumps
    single = calls_grammar(tool_use([WEATHER, ADD], "required", False), {})  # type: ignore[arg-type]
    named = calls_grammar(tool_use([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, None), {})  # type: ignore[arg-type]
    assert single is not None and named is not None
    assert _accepts(single, one) and not _accepts(single, two)  # parallel_tool_calls false: one call
    assert not _accepts(named, one) and _accepts(named, two.split("\n", 3)[3])
    assert calls_grammar(tool_use([WEATHER], "auto", None), {}) is None  # type: ignore[arg-type]


def _qwen_like_tokenizer(special: bool = False) -> tuple[Tokenizer, ModelTokenizer]:
    """A byte-level BPE with the tags as added tokens (ids 318 and 319) that are not special, as
    Qwen2.5's and Qwen3's tokenizers have them, or are."""
    tok = build_byte_level_tokenizer(318)
    tok.add_tokens([AddedToken(OPEN, special=special), AddedToken(CLOSE, special=special)])
    info = ModelInfo(name="qwen-like", max_model_len=512, vocab_size=320, eos_token_ids=[2], bos_token_id=None,
                     tokenizer_json=tok.to_str(), chat_template=None, add_bos_token=False, num_kv_blocks=8,
                     block_size=16)
    return tok, ModelTokenizer(info)


def test_tags_that_are_tokens_are_named_as_tokens_and_their_text_reaches_the_parser() -> None:
    tok, ours = _qwen_like_tokenizer()
    assert ours.tool_tags == {OPEN: 318, CLOSE: 319}
    assert ModelTokenizer(_plain_info()).tool_tags == {}  # tags written byte by byte
    use = tool_use([WEATHER, ADD], "required", None)
    assert use is not None
    ll = llguidance.LLTokenizer(tok.to_str(), n_vocab=320, eos_token=[2])
    one = f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}'
    text = f'{one}\n{OPEN}\n{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}\n{CLOSE}'
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids.count(318) == ids.count(319) == 2  # the tokenizer writes each tag as its token

    # Before: the tag as a string. llguidance counts added tokens as special and allows the tag's
    # token alone, then refuses it: the output ended after one token.
    spelled = llguidance.LLMatcher(ll, calls_grammar(use, {}))  # type: ignore[arg-type]
    first = spelled.compute_logit_bias()
    assert [i for i in range(320) if first[i]] == [318]
    assert not spelled.consume_token(318) and spelled.is_error()

    grammar = calls_grammar(use, ours.tool_tags)
    assert grammar is not None and "<[318]>" in grammar and "<[319]>" in grammar
    matcher = llguidance.LLMatcher(ll, grammar)
    assert not matcher.is_error(), matcher.get_error()
    assert matcher.consume_tokens(ids) and matcher.is_accepting(), matcher.get_error()
    assert not llguidance.LLMatcher(ll, grammar).consume_tokens(tok.encode("Paris", add_special_tokens=False).ids)

    # Not special to the tokenizer, the tags keep their text when special tokens are skipped (the
    # default), so the call parser finds the calls in what the detokenizer gives.
    detok = IncrementalDetokenizer(ours, [], skip_special_tokens=True)
    written = "".join(detok.push(i) for i in ids)
    assert written == text
    parser = ToolCallParser()
    assert parser.feed(written, final=True).content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("get_weather", {"city": "Paris"}),
                                                                         ("add", {"a": 1, "b": 2})]


def test_tags_that_are_special_tokens_are_given_their_text_for_the_call_parser() -> None:
    tok, ours = _qwen_like_tokenizer(special=True)
    assert ours.tool_tags == {OPEN: 318, CLOSE: 319} and ours.hidden_tool_tags == {318: OPEN, 319: CLOSE}
    assert _qwen_like_tokenizer()[1].hidden_tool_tags == {}
    use = tool_use([WEATHER], "required", None)
    text = f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}'
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ours.decode(ids) == text[len(OPEN):-len(CLOSE)]  # skipped: the parser would see no call

    def answered(streaming: bool, tools: bool) -> list[dict]:
        processor = OutputProcessor(lambda rid: None)
        request = AddRequest(10, "chatcmpl-x", [5, 6], SamplingParams(max_tokens=64))
        renderer = ChatRenderer("chatcmpl-x", 0, "m", ours, [5, 6], False, None, tools=use)
        output = Output(request, ours, [], renderer, streaming, include_usage=False, tools=tools)
        processor.add(output)
        for i, token in enumerate([*ids, 2]):
            end = [Finish(10, "stop", 2, 0, i + 1)] if token == 2 else []
            processor.process(TokenBatch([10], [token], end, pack_logprobs([])))
        if not streaming:
            return [output.body()["choices"][0]["message"]]
        chunks = b"".join(output.buffer).split(b"\n\n")
        return [json.loads(c[6:])["choices"][0]["delta"] for c in chunks if c.startswith(b"data: {")]

    (message,) = answered(streaming=False, tools=True)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] \
        == [("get_weather", '{"city": "Paris"}')]
    deltas = answered(streaming=True, tools=True)
    assert [c["function"].get("name") for d in deltas for c in d.get("tool_calls", []) if "id" in c] == ["get_weather"]
    assert not any(d.get("content") for d in deltas)
    # Without the tags' text the stream reads no call: its JSON goes out as content.
    unread = answered(streaming=True, tools=False)
    assert not any("tool_calls" in d for d in unread) and '"city"' in "".join(d.get("content", "") for d in unread)


def _plain_info() -> ModelInfo:
    tok = build_byte_level_tokenizer(320)
    return ModelInfo(name="plain", max_model_len=512, vocab_size=320, eos_token_ids=[2], bos_token_id=1,
                     tokenizer_json=tok.to_str(), chat_template=None, add_bos_token=True, num_kv_blocks=8,
                     block_size=16)


# ------------------------------------------------------------------------------------ templates

KNOWS_TOOLS = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}<call>{{ call.function.name }} {{ call.function.arguments | tojson }}</call>"
    "{%- endfor %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
PLAIN = "{%- for m in messages %}[{{ m.role }}] {{ m.content }}\n{%- endfor %}[assistant]"
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris, and 2+3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 °C"},
    {"role": "tool", "tool_call_id": "c2", "content": "5"},
]


@pytest.mark.parametrize("chat_template", [KNOWS_TOOLS, [{"name": "default", "template": PLAIN},
                                                         {"name": "tool_use", "template": KNOWS_TOOLS}]],
                         ids=["template", "tool_use-template"])
def test_a_template_that_knows_tools_renders_them_as_transformers_does(tmp_path: Path, chat_template: Any) -> None:
    from transformers import AutoTokenizer

    path = _model_dir(tmp_path / "model", {"chat_template": chat_template})
    ours, hf = _sluice(path), AutoTokenizer.from_pretrained(str(path))
    assert ours.knows_tools
    use = tool_use([WEATHER, ADD], None, None)
    assert use is not None
    messages = prompt_messages(CONVERSATION, use, knows_tools=True)
    # Arguments parsed, as vLLM gives them to templates (and as they render them: as JSON objects).
    hf_messages = [m | {"tool_calls": [c | {"function": c["function"] | {"arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in CONVERSATION]
    want = hf.apply_chat_template(hf_messages, tools=use.tools, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages, use.tools) == want
    assert '<call>add {"a": 2, "b": 3}</call>' in want and '"name": "get_weather"' in want
    if isinstance(chat_template, list):  # without tools, the default template
        assert ours.render_chat(CONVERSATION[:1]).startswith("[user] Weather")


def test_a_template_that_does_not_know_tools_gets_them_written_in(tmp_path: Path) -> None:
    ours = _sluice(_model_dir(tmp_path / "model", {"chat_template": PLAIN}))
    assert not ours.knows_tools
    use = tool_use([WEATHER], None, None)
    text = ours.render_chat(prompt_messages(CONVERSATION, use, knows_tools=False))
    assert text.startswith("[system] You can call functions") and json.dumps(WEATHER) in text
    # Answered calls: each result beside the question, with the call it answers (written as turns
    # of their own, a small model parrots the result back instead of answering).
    assert text.endswith('[user] Weather in Paris, and 2+3?\n\nget_weather({"city": "Paris"}) returned: sunny, 21 °C'
                         '\n\nadd({"a": 2, "b": 3}) returned: 5[assistant]'), text
    # A call not answered (yet) is written as the model writes calls.
    pending = ours.render_chat(prompt_messages(CONVERSATION[:2], use, knows_tools=False))
    assert pending.endswith(f'[assistant] {OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}'
                            f'\n{OPEN}\n{{"name": "add", "arguments": {{"a": 2, "b": 3}}}}\n{CLOSE}[assistant]'), pending
    # The assistant's own words beside its calls stay its turn; the results then make a turn of their own.
    said = [CONVERSATION[0], CONVERSATION[1] | {"content": "Let me look."}, *CONVERSATION[2:]]
    assert ours.render_chat(prompt_messages(said, use, knows_tools=False)).endswith(
        "[assistant] Let me look.[user] get_weather({\"city\": \"Paris\"}) returned: sunny, 21 °C\n\n"
        "add({\"a\": 2, \"b\": 3}) returned: 5[assistant]")
    # tool_choice none: the model is not told of tools it may not call.
    unshown = ours.render_chat(prompt_messages(CONVERSATION[:1], None, knows_tools=False))
    assert unshown == "[user] Weather in Paris, and 2+3?[assistant]"


# ------------------------------------------------------------------------------------ parsing


def _feed_all(pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[tuple[str, str]]]:
    """(content, calls as streamed: name and reassembled arguments, calls as the parser kept them)."""
    parser = ToolCallParser()
    content, names, args = "", {}, {}
    for i, piece in enumerate(pieces):
        events = parser.feed(piece, final=i == len(pieces) - 1)
        content += events.content
        for index, call in events.started:
            assert index not in names, "a call starts once"
            names[index] = call.name
        for index, fragment in events.arguments:
            assert index in names, "arguments after the call's start"
            args[index] = args.get(index, "") + fragment
    streamed = [(names[i], args.get(i, "")) for i in sorted(names)]
    return content, streamed, [(c.name, c.arguments) for c in parser.calls]


TEXT = st.lists(st.sampled_from([*"ab <>/{}\"\\\n:,_", "tool_call", "é", "🙂"]), max_size=12).map("".join)
ARGS = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(before=TEXT, calls=st.lists(st.tuples(st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
                                              st.dictionaries(st.text(max_size=5), ARGS, max_size=3)), max_size=3),
       compact=st.booleans(), cuts=st.lists(st.integers(1, 9), min_size=1, max_size=40))
def test_the_parser_gives_the_same_calls_however_the_text_is_cut(
        before: str, calls: list[tuple[str, dict]], compact: bool, cuts: list[int]) -> None:
    sep = (",", ":") if compact else (", ", ": ")
    while OPEN in before:
        before = before.replace(OPEN, "")
    written = [json.dumps({"name": n, "arguments": a}, separators=sep) for n, a in calls]
    text = before + "".join(f"{OPEN}\n{w}\n{CLOSE}\n" for w in written)
    pieces, at = [], 0
    for n in cuts * (len(text) // max(sum(cuts), 1) + 1):
        if at >= len(text):
            break
        pieces.append(text[at : at + n])
        at += n
    content, streamed, kept = _feed_all(pieces or [""])
    want = [(n, json.dumps(a, separators=sep)) for n, a in calls]
    assert streamed == kept == want
    assert content == (before if calls else text)


def test_text_that_only_looks_like_a_call_is_content() -> None:
    for text in ("a < b and <tool_ but no call", f"{OPEN}not json{CLOSE} after", f"x {OPEN}\n{{\"name\": \"f\""):
        content, streamed, _ = _feed_all(list(text))
        assert (content, streamed) == (text, []), text
    # Arguments before the name: read whole at the close tag.
    content, streamed, _ = _feed_all(list(f'{OPEN}{{"arguments": {{"x": 1}}, "name": "f"}}{CLOSE}'))
    assert (content, streamed) == ("", [("f", '{"x": 1}')])


def test_llama3_calls_are_the_whole_answer() -> None:
    call = parse_llama3_call('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert call is not None and (call.name, json.loads(call.arguments)) == ("add", {"a": 1, "b": 2})
    assert parse_llama3_call('{"a": 1}') is None and parse_llama3_call("Sure: {}") is None
