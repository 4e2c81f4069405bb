"""Reasoning output without a server: the ``<think>`` parser split at every point gives what the
whole text gives, and its cases (an opening tag, a prompt that opened it, none, a block cut short,
whitespace around the tags)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.reasoning import ReasoningParser


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
