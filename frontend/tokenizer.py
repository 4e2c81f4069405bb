"""The served model's tokenizer and chat template, built from what the worker reported.

The frontend never reads model files: the worker sends the serialized ``tokenizers`` tokenizer and
the chat template in ``ModelInfo``, so a frontend on another host needs no shared volume.
"""

from __future__ import annotations

from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer

from protocol.messages import ModelInfo

# Used when the model ships no chat template: one line per message, then the assistant's turn.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _raise_exception(message: str) -> None:
    # Chat templates call raise_exception() to reject conversations they cannot render.
    raise jinja2.TemplateError(message)


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered by the model's chat template (a client error)."""


class ModelTokenizer:
    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self._tok = Tokenizer.from_str(info.tokenizer_json)
        self.vocab_size = info.vocab_size
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(info.chat_template or DEFAULT_CHAT_TEMPLATE)
        self._bos_text = self._token_text(info.bos_token_id)
        eos = info.eos_token_ids[0] if info.eos_token_ids else None
        self._eos_text = self._token_text(eos)

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._tok.id_to_token(token_id) or ""

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a completion prompt, with the BOS token the model expects."""
        ids: list[int] = self._tok.encode(text, add_special_tokens=True).ids
        bos = self.info.bos_token_id
        if self.info.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self._bos_text,
                eos_token=self._eos_text,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template rejected the messages: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Render the chat template and tokenize it as HF does: special tokens come from the
        template text itself (add_special_tokens=False), except a BOS the template omitted."""
        text = self.render_chat(messages)
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        bos = self.info.bos_token_id
        if (
            self.info.add_bos_token
            and bos is not None
            and self._bos_text not in text[: len(self._bos_text) + 8]
            and (not ids or ids[0] != bos)
        ):
            ids.insert(0, bos)
        return ids

    def token_str(self, token_id: int) -> str:
        """A token's text for logprobs: decoded, or its vocabulary entry when it is only part of
        a character (decoding would give U+FFFD, the same for many tokens)."""
        text: str = self._tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            return self._tok.id_to_token(token_id) or text
        return text

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return text


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    Decoding a single token alone is wrong for byte-level and sentencepiece tokenizers (a
    character may span tokens; a leading space may depend on the previous token), so each step
    decodes a short window that starts a few tokens back and emits only the text past what that
    window already produced. A window ending in U+FFFD is an incomplete UTF-8 sequence: wait.
    """

    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: ModelTokenizer, prompt_ids: list[int]) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-self.CONTEXT_TOKENS :])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # tokens whose text has been emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        full_text = self._tok.decode(self._ids[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self._ids)
            return delta
        return ""


class StopStringMatcher:
    """Finds the first stop string in generated text and holds back text that may start one.

    ``feed(delta)`` returns ``(text_safe_to_send, stopped)``. While not stopped, the last
    ``longest-1`` characters are held back because they might be the start of a stop string;
    ``flush()`` releases them at the end of generation.
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._text = ""
        self._sent = 0

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self._stops:
            return delta, False
        search_from = max(0, len(self._text) - self._hold)
        self._text += delta
        cut = -1
        for stop in self._stops:
            i = self._text.find(stop, search_from)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut != -1:
            out = self._text[self._sent : cut]
            self._sent = cut
            return out, True
        safe_end = max(self._sent, len(self._text) - self._hold)
        out = self._text[self._sent : safe_end]
        self._sent = safe_end
        return out, False

    def flush(self) -> str:
        out = self._text[self._sent :]
        self._sent = len(self._text)
        return out
