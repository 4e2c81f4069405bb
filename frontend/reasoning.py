"""Reasoning output: a thinking model's ``<think>...</think>`` block, told apart from its answer.

Models that think before they answer (Qwen3, QwQ, DeepSeek-R1 and its distills) write

    <think>
    the reasoning
    </think>

    the answer

and the chat message's ``reasoning_content`` is the reasoning, its ``content`` the answer (as
SGLang and DeepSeek's API name them; vLLM's ``--reasoning-parser``s split the same way). Where
the block begins is decided once per request, from the prompt:

* the rendered prompt ends inside an open ``<think>`` (DeepSeek-R1's and Qwen3-Thinking-2507's
  templates put ``<think>\\n`` into the generation prompt): the output starts as reasoning, up to
  ``</think>``; with no ``</think>`` at all (``max_tokens`` cut the thinking) all of it is;
* otherwise the output is reasoning only if it opens with ``<think>`` (Qwen3's hybrid models; a
  closed ``<think>\\n\\n</think>`` in the prompt, as ``enable_thinking: false`` renders it, is no
  open block); an output that starts with anything else is all content, tags and all.

There is one block, at the start: a ``<think>`` later in the answer is the answer's text. The
reasoning is trimmed of the whitespace inside its tags, and the answer of the whitespace after
``</think>`` (Qwen3 writes ``</think>\\n\\n``), as the models' own templates trim both when they
render a past turn. The tags are read in the text, wherever a token boundary falls: text that may
be the start of a tag is held back until the next token says (as ``StopStringMatcher`` holds back
a window), so a stream split at any point gives the whole answer's split.
"""

from __future__ import annotations

import enum

THINK, END_THINK = "<think>", "</think>"


class Phase(enum.Enum):
    OPENING = "opening"  # only whitespace so far: the output may still open a block
    THINKING = "thinking"  # inside the block
    CLOSED = "closed"  # right after </think>: whitespace dropped until the answer starts
    ANSWER = "answer"  # the rest, passed through


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """One choice's output text, split as it streams into reasoning and content.

    ``feed(text, tokens)`` takes the text of the next ``tokens`` tokens and returns the
    (reasoning, content) that can be sent now; ``flush()`` returns what was held back, at the
    end of the output. ``reasoning_tokens`` counts the tokens of the think block, its tags
    included (usage's ``completion_tokens_details.reasoning_tokens``)."""

    __slots__ = ("_fresh", "_held", "_opened", "_undecided", "phase", "reasoning_tokens")

    def __init__(self, thinking: bool) -> None:
        """``thinking``: the prompt left a ``<think>`` open, so the output starts inside it."""
        self.phase = Phase.THINKING if thinking else Phase.OPENING
        self._opened = thinking  # the output has a think block
        self._fresh = True  # thinking, nothing of the reasoning sent yet: its leading whitespace is dropped
        self._held = ""
        self._undecided = 0  # tokens fed while OPENING: the block's if one opens
        self.reasoning_tokens = 0

    def feed(self, text: str, tokens: int = 1) -> tuple[str, str]:
        before = self.phase
        reasoning, content = self._split(text) if text else ("", "")
        if before is Phase.THINKING:
            self.reasoning_tokens += tokens
        elif before is Phase.OPENING:
            if self.phase is Phase.OPENING:
                self._undecided += tokens
            elif self._opened:
                self.reasoning_tokens += self._undecided + tokens
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is still held back, once the output is complete: an unfinished tag is text."""
        held, self._held = self._held, ""
        if self.phase is Phase.OPENING:
            return "", held
        if self.phase is Phase.THINKING:
            return (held if self._fresh else held.rstrip()), ""
        return "", ""

    def _split(self, text: str) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        reasoning = content = ""
        while buf:
            phase = self.phase
            if phase is Phase.ANSWER:
                content += buf
                break
            if phase is Phase.CLOSED:
                buf = buf.lstrip()
                if buf:
                    self.phase = Phase.ANSWER
                continue
            if phase is Phase.OPENING:
                start = buf.lstrip()
                if start.startswith(THINK):
                    buf, self.phase, self._opened = start[len(THINK):], Phase.THINKING, True
                elif THINK.startswith(start):  # whitespace, or the beginning of a tag: wait and see
                    self._held = buf
                    break
                else:
                    self.phase = Phase.ANSWER
                continue
            # THINKING
            if self._fresh:
                start = buf.lstrip()
                if start.startswith(THINK):  # the model repeats the prompt's <think>
                    buf = start[len(THINK):]
                    continue
                if not start:
                    break
                if THINK.startswith(start):
                    self._held = start
                    break
                buf, self._fresh = start, False
            end = buf.find(END_THINK)
            if end != -1:
                reasoning += buf[:end].rstrip()
                buf, self.phase = buf[end + len(END_THINK):], Phase.CLOSED
                continue
            # Held back: a tail that may begin </think>, and the whitespace before it (dropped
            # if the tag follows).
            body = buf[:len(buf) - _partial_tail(buf, END_THINK)]
            sent = body.rstrip()
            reasoning += sent
            self._held = buf[len(sent):]
            break
        return reasoning, content
