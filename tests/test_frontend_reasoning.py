"""Reasoning output without a server: the ``<think>`` parser split at every point gives what the
whole text gives; its cases (an opening tag, a prompt that opened it, none, a block cut short,
whitespace around the tags); and the chat and responses shapes that an ``Output`` renders from it
(deltas in order, one per token, logprobs per token, usage's reasoning tokens)."""

from __future__ import annotations

import json

import pytest
from fake_scheduler import model_info
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from frontend.output import Output, OutputProcessor
from frontend.reasoning import ReasoningParser
from frontend.render import ChatRenderer
from frontend.responses_input import input_messages, output_messages
from frontend.responses_render import ResponsesRenderer
from frontend.tokenizer import ModelTokenizer
from frontend.tools import tool_use
from protocol.messages import AddRequest, Finish, ModelInfo, SamplingParams, TokenBatch, pack_logprobs
from worker.model.tiny import build_byte_level_tokenizer


def whole(text: str, thinking: bool) -> tuple[str, str]:
    parser = ReasoningParser(thinking)
    reasoning, content = parser.feed(text)
    rest = parser.flush()
    return reasoning + rest[0], content + rest[1]


def pieces(parts: list[str], thinking: bool) -> tuple[str, str, int]:
    parser = ReasoningParser(thinking)
    reasoning = content = ""
    for part in parts:
        r, c = parser.feed(part)
        reasoning, content = reasoning + r, content + c
    r, c = parser.flush()
    return reasoning + r, content + c, parser.reasoning_tokens


@pytest.mark.parametrize(("text", "thinking", "reasoning", "content"), [
    # Qwen3 (hybrid): the model opens the block; whitespace inside the tags and after them is not text.
    ("<think>\nFirst, 2+2.\n</think>\n\nIt is 4.", False, "First, 2+2.", "It is 4."),
    # DeepSeek-R1, Qwen3-Thinking-2507: the prompt opened it; the output only closes it.
    ("First, 2+2.\n</think>\n\nIt is 4.", True, "First, 2+2.", "It is 4."),
    # ... and a model that repeats the prompt's <think> has it dropped.
    ("<think>\nFirst.</think>4", True, "First.", "4"),
    # No block: all content, exactly as written (leading whitespace too).
    ("  It is 4.\n", False, "", "  It is 4.\n"),
    # The prompt opened it and max_tokens cut the thinking: all reasoning.
    ("First, 2+2 is", True, "First, 2+2 is", ""),
    ("<think>\nFirst, 2+2 is\n\n", False, "First, 2+2 is", ""),
    # One block, at the start: tags later in the answer are its text.
    ("It is <think>4</think>.", False, "", "It is <think>4</think>."),
    ("<think>a</think>b<think>c</think>", False, "a", "b<think>c</think>"),
    ("</think>4", False, "", "</think>4"),
    # An empty block (Qwen3 told not to think writes one): no reasoning.
    ("<think>\n\n</think>\n\nIt is 4.", False, "", "It is 4."),
    # A tag cut off at the end of the output is text.
    ("<thi", False, "", "<thi"),
    ("<think>a\n</thi", False, "a\n</thi", ""),
    ("a </think", True, "a </think", ""),
    # Whitespace inside the reasoning stays; the answer's own trailing whitespace too.
    ("<think> a \n\n b </think>c \n", False, "a \n\n b", "c \n"),
])
def test_cases(text: str, thinking: bool, reasoning: str, content: str) -> None:
    assert whole(text, thinking) == (reasoning, content)
    assert pieces(list(text), thinking)[:2] == (reasoning, content)  # one character a token


FRAGMENTS = ["<think>", "</think>", "<", "</", "<th", "</thi", "think", "ink>", ">", "/", "\n", "\n\n", " ", "a",
             "b c", "é", "<tool_call>"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=16).map("".join), st.booleans(), st.data())
def test_any_split_gives_the_whole_texts_split(text: str, thinking: bool, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert pieces(parts, thinking)[:2] == whole(text, thinking)


@settings(max_examples=200, deadline=None)
@given(st.text("ab \n<>/", max_size=12), st.text("ab \n<>/", max_size=12), st.booleans(), st.booleans(), st.data())
def test_a_block_and_an_answer_come_apart(thought: str, answer: str, opened: bool, repeat: bool,
                                          data: st.DataObject) -> None:
    """Whatever the reasoning and the answer say (their alphabet spells no tag), split anywhere:
    the reasoning without the whitespace inside its tags, the answer without the whitespace after
    them, whether the model or the prompt opened the block (or both)."""
    text = ("<think>" if repeat or not opened else "") + thought + "</think>" + answer
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert pieces(parts, opened)[:2] == (thought.strip(), answer.lstrip())


def test_reasoning_tokens_are_the_blocks_tags_included() -> None:
    tokens = ["<think>", "\n", "Two", " and two", "\n", "</think>", "\n\n", "Four", "."]
    assert pieces(tokens, False) == ("Two and two", "Four.", 6)
    assert pieces(tokens[1:], True)[2] == 5
    # Whitespace and a tag's first half before the block are the block's; none of a plain answer is.
    assert pieces(["\n", "<th", "ink>", "a", "</think>", "b"], False)[2] == 5
    assert pieces(["\n", "<th", "x", "</think>"], False) == ("", "\n<thx</think>", 0)
    assert pieces(["a", "b"], True)[2] == 2  # cut while thinking: all of it


# ---------------------------------------------------------------------------------- through an Output

THOUGHT = ["<think>", "\n", "Two", " and", " two", "\n", "</think>", "\n\n", "Four", "."]


def think_tokenizer(special: bool = False) -> ModelTokenizer:
    """A byte-level tokenizer with <think> and </think> as added tokens (special ones: their text
    is skipped when decoding, as some tokenizers mark them)."""
    tok = build_byte_level_tokenizer(510)
    tok.add_tokens([AddedToken("<think>", special=special), AddedToken("</think>", special=special)])
    info = model_info()
    return ModelTokenizer(ModelInfo(name="fake", max_model_len=512, vocab_size=512, eos_token_ids=[2], bos_token_id=1,
                                    tokenizer_json=tok.to_str(), chat_template=None, add_bos_token=True,
                                    num_kv_blocks=info.num_kv_blocks, block_size=16))


def thought_ids(tokenizer: ModelTokenizer) -> tuple[list[int], int]:
    """``THOUGHT``'s token ids, and how many of them are the think block's."""
    ids = [i for piece in THOUGHT for i in tokenizer.encode_text(piece)]
    return ids, ids.index(tokenizer.encode_text("</think>")[0]) + 1


def run_output(tokenizer: ModelTokenizer, renderer: object, streaming: bool, n: int = 1,
               logprobs: bool = False) -> tuple[Output, bytes]:
    """``THOUGHT``'s tokens through an ``Output`` (each choice the same), as the processor feeds them."""
    ids, _ = thought_ids(tokenizer)
    request = AddRequest(10, "chatcmpl-x", [1, 5, 6], SamplingParams(max_tokens=64, logprobs=0 if logprobs else None),
                         n=n)
    output = Output(request, tokenizer, [], renderer, streaming, include_usage=True, reasoning=False)  # type: ignore[arg-type]
    processor = OutputProcessor(lambda rid: None)
    processor.add(output)
    data = b""
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        rids = list(range(10, 10 + n))
        lp = pack_logprobs([(rid, (-0.5, [token], [-0.5])) for rid in rids]) if logprobs else pack_logprobs([])
        processor.process(TokenBatch(rids, [token] * n, [Finish(r, "stop", 3, 0, i + 1) for r in rids] if last else [],
                                     lp))
        data += b"".join(output.buffer)
        output.buffer.clear()
    return output, data


def chunks(data: bytes) -> list[dict]:
    return [json.loads(e[len(b"data: "):]) for e in data.split(b"\n\n") if e.startswith(b"data: {")]


@pytest.mark.parametrize("special", [False, True])
def test_a_chat_stream_sends_reasoning_then_content(special: bool) -> None:
    tokenizer = think_tokenizer(special)
    renderer = ChatRenderer("chatcmpl-x", 0, "m", tokenizer, [1, 5, 6], False, None)
    _, data = run_output(tokenizer, renderer, streaming=True, n=2)
    events = chunks(data)
    for index in (0, 1):
        deltas = [e["choices"][0]["delta"] for e in events if e.get("choices") and e["choices"][0]["index"] == index]
        assert deltas[0]["role"] == "assistant"
        kinds = [k for d in deltas for k in d if k != "role" and d[k]]
        assert kinds == sorted(kinds, key=["reasoning_content", "content"].index), kinds  # reasoning first
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Two and two"
        assert "".join(d.get("content") or "" for d in deltas) == "Four."
    usage = events[-1]["usage"]
    ids, thinking = thought_ids(tokenizer)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 2 * thinking}
    assert usage["completion_tokens"] == 2 * len(ids)


def test_a_lagging_clients_merged_chunk_has_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("frontend.output.COALESCE_AFTER", 0)  # every token waits for the writer
    tokenizer = think_tokenizer()
    _, data = run_output(tokenizer, ChatRenderer("chatcmpl-x", 0, "m", tokenizer, [1, 5, 6], False, None),
                         streaming=True)
    (merged,) = [e for e in chunks(data) if e.get("choices")]
    assert merged["choices"][0]["delta"] == {"role": "assistant", "reasoning_content": "Two and two",
                                             "content": "Four."}


def test_logprobs_stay_one_per_token_in_order() -> None:
    tokenizer = think_tokenizer()
    renderer = ChatRenderer("chatcmpl-x", 0, "m", tokenizer, [1, 5, 6], False, 0)
    _, data = run_output(tokenizer, renderer, streaming=True, logprobs=True)
    events = chunks(data)
    tokens = [t["token"] for e in events if e.get("choices") and (lp := e["choices"][0]["logprobs"])
              for t in lp["content"]]
    ids, _ = thought_ids(tokenizer)
    assert tokens == [tokenizer.token_str(i) for i in ids]
    whole_output, _ = run_output(tokenizer, ChatRenderer("chatcmpl-x", 0, "m", tokenizer, [1, 5, 6], False, 0),
                                 streaming=False, logprobs=True)
    (answer,) = whole_output.body()["choices"]
    assert [t["token"] for t in answer["logprobs"]["content"]] == tokens
    assert answer["message"] == {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two"}


def test_tool_calls_are_read_from_the_content_only() -> None:
    tokenizer = think_tokenizer()
    use = tool_use([{"type": "function", "function": {"name": "f"}}], "auto", True)
    renderer = ChatRenderer("chatcmpl-x", 0, "m", tokenizer, [1, 5, 6], False, None, tools=use)
    text = '<think>maybe <tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>?</think>\n\n' \
           '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    reasoning, content = whole(text, False)
    answer = renderer.answer(_Piece(), content, [], [], "stop", None, reasoning)
    assert answer["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in answer["message"]["tool_calls"]] == ["f"]
    assert answer["message"]["reasoning_content"].startswith("maybe <tool_call>")


class _Piece:
    index, text_offset, first_chunk, prompt_logprobs = 0, 0, True, None


def test_a_responses_stream_has_a_reasoning_item_before_the_message() -> None:
    tokenizer = think_tokenizer()
    done: list[dict] = []
    renderer = ResponsesRenderer("resp_x", 1, "m", {}, None, done.append)
    _, data = run_output(tokenizer, renderer, streaming=True)
    events = [json.loads(block.split("\n")[1].removeprefix("data: ")) for block in data.decode().split("\n\n") if block]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = done[0]
    reasoning, message = final["output"]
    assert reasoning["type"] == "reasoning" and reasoning["status"] == "completed"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Two and two"}] and reasoning["summary"] == []
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Two and two"
    assert message["content"][0]["text"] == "Four."
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": thought_ids(tokenizer)[1]}
    # The whole answer has the same items; the next turn gets the reasoning back on its assistant turn.
    whole_output, _ = run_output(tokenizer, ResponsesRenderer("resp_y", 1, "m", {}, None), streaming=False)
    body = whole_output.body()
    assert [i["type"] for i in body["output"]] == ["reasoning", "message"]
    assert output_messages(body["output"]) == [{"role": "assistant", "content": "Four.",
                                                "reasoning_content": "Two and two"}]


def test_reasoning_input_items_go_to_the_next_assistant_turn() -> None:
    items = [{"role": "user", "content": "weather?"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Ask."}]},
             {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sun"},
             {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Say it."}]},
             {"role": "assistant", "content": "Sunny."}]
    messages = input_messages(items)
    assert [m.get("reasoning_content") for m in messages] == [None, "Ask.", None, "Say it."]
