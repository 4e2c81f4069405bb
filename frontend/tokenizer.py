"""The served model's tokenizer and chat template, built from what the worker reported.

The frontend never reads model files: the worker sends the serialized ``tokenizers`` tokenizer and
the chat template in ``ModelInfo``, so a frontend on another host needs no shared volume.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from frontend.reasoning import END_THINK, THINK
from frontend.tool_calls import CLOSE, OPEN
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


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; templates written for transformers expect
    # plain JSON with non-ASCII text kept (tool schemas end up in the prompt verbatim).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    # Templates that put today's date in the system prompt (Llama 3.x) call this.
    return datetime.datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; for
    serving it renders its body unchanged (templates that use it fail to parse without it)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def chat_environment() -> jinja2.Environment:
    """A sandbox that renders chat templates the way ``transformers`` does: trimmed blocks,
    loop controls, the same ``tojson``, ``raise_exception`` and ``strftime_now``."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered by the model's chat template (a client error)."""


class PromptTooLong(ValueError):
    """A text longer than any prompt that fits the context, refused before tokenizing it."""


class ModelTokenizer:
    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self._tok = Tokenizer.from_str(info.tokenizer_json)
        self.vocab_size = info.vocab_size
        self._template: jinja2.Template | None = None
        self._template_error = ""
        try:
            self._template = chat_environment().from_string(info.chat_template or DEFAULT_CHAT_TEMPLATE)
        except jinja2.TemplateSyntaxError as e:
            # The model's own file is broken: chat requests say so; completions still work.
            self._template_error = f"this model's chat template does not parse (line {e.lineno}: {e.message})"
        self._bos_text = self._token_text(info.bos_token_id)
        eos = info.eos_token_ids[0] if info.eos_token_ids else None
        self._eos_text = self._token_text(eos)

    # Texts this long are encoded with encode_batch, which lets go of the GIL (encode holds it
    # throughout), so that tokenizing them on a thread leaves the event loop running.
    GIL_FREE_CHARS = 8192

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters any one token stands for: its vocabulary entry's length (a byte
        of byte-level BPE is one character there, a sentencepiece space is U+2581), or an added
        token's text."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def max_text_chars(self, max_tokens: int) -> int:
        """A text longer than this is more than ``max_tokens`` tokens, whatever it says: it can
        be refused by its length, without seconds of tokenizing (a tokenizer whose normalizer
        deletes characters could fit more; such a text is refused anyway)."""
        return max_tokens * self.max_token_chars

    def _check_chars(self, text: str, max_chars: int | None, what: str) -> None:
        if max_chars is not None and len(text) > max_chars:
            raise PromptTooLong(f"the {what} has {len(text)} characters; at most {max_chars} can fit in this "
                                f"model's context (no token stands for more than {self.max_token_chars} characters)")

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) >= self.GIL_FREE_CHARS:
            ids: list[int] = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            return ids
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._tok.id_to_token(token_id) or ""

    def encode_prompt(self, text: str, max_chars: int | None = None) -> list[int]:
        """Token ids of a completion prompt, with the BOS token the model expects; a prompt of
        more than ``max_chars`` characters raises ``PromptTooLong`` untokenized."""
        self._check_chars(text, max_chars, "prompt")
        ids = self._encode(text, add_special_tokens=True)
        bos = self.info.bos_token_id
        if self.info.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` alone: no BOS or other special token added."""
        return self._encode(text, add_special_tokens=False)

    @property
    def knows_tools(self) -> bool:
        """Whether the chat template for requests with tools renders them itself (names them)."""
        return "tools" in (self.info.tool_chat_template or self.info.chat_template or "")

    @functools.cached_property
    def _tool_template(self) -> jinja2.Template | None:
        if self.info.tool_chat_template is None:
            return self._template
        try:
            return chat_environment().from_string(self.info.tool_chat_template)
        except jinja2.TemplateSyntaxError as e:
            self._template_error = f"this model's tool_use chat template does not parse (line {e.lineno}: {e.message})"
            return None

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """The conversation as the model's template renders it; with ``tools``, the model's
        ``tool_use`` template if it has one (as transformers chooses). ``template_kwargs``: the
        request's own variables (vLLM's ``chat_template_kwargs``), over the defaults."""
        template = self._tool_template if tools else self._template
        if template is None:
            raise ChatTemplateError(self._template_error)
        variables = {"add_generation_prompt": True, "bos_token": self._bos_text, "eos_token": self._eos_text,
                     **(template_kwargs or {})}
        try:
            # transformers passes tools and documents always, so `tools is none` tests see None.
            return template.render(variables, messages=messages, tools=tools, documents=None)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            # Also a template's own slip on an unexpected conversation (a None content added to
            # a string, messages[0] of nothing): the client's request cannot be rendered.
            raise ChatTemplateError(f"chat template rejected the messages: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], max_chars: int | None = None,
                    tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None
                    ) -> list[int]:
        """Render the chat template and tokenize it as ``transformers``' ``apply_chat_template``
        does: special tokens come from the template text alone (add_special_tokens=False). The
        plain default template has no BOS of its own, so prompts rendered with it get the one
        the model expects, as completion prompts do. A rendering of more than ``max_chars``
        characters raises ``PromptTooLong`` untokenized."""
        text = self.render_chat(messages, tools, template_kwargs)
        self._check_chars(text, max_chars, "rendered conversation")
        ids = self._encode(text, add_special_tokens=False)
        bos = self.info.bos_token_id
        if self.info.chat_template is None and self.info.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    @functools.cached_property
    def think_tags(self) -> dict[int, str]:
        """The ids of ``<think>`` and ``</think>`` when the tokenizer has both as tokens (added
        tokens or vocabulary entries), as the models that think in such blocks have them;
        empty otherwise."""
        tags = {self._tok.token_to_id(tag): tag for tag in (THINK, END_THINK)}
        return {} if None in tags else {i: tag for i, tag in tags.items() if i is not None}

    def _special(self, tags: dict[int, str]) -> dict[int, str]:
        added = self._tok.get_added_tokens_decoder()
        return {i: tag for i, tag in tags.items() if i in added and added[i].special}

    @functools.cached_property
    def hidden_think_tags(self) -> dict[int, str]:
        """Those of ``think_tags`` that are special tokens: decoding skips their text, so the
        reasoning parser is given it by id."""
        return self._special(self.think_tags)

    @functools.cached_property
    def tool_tags(self) -> dict[str, int]:
        """``<tool_call>`` and ``</tool_call>``, each by the id of the one token the tokenizer
        writes it as (Qwen2.5's and Qwen3's added tokens); a tag written in pieces is absent."""
        ids = {tag: self.encode_text(tag) for tag in (OPEN, CLOSE)}
        return {tag: written[0] for tag, written in ids.items() if len(written) == 1}

    @functools.cached_property
    def hidden_tool_tags(self) -> dict[int, str]:
        """Those of ``tool_tags`` that are special tokens (Qwen's are not; a fine-tune that named a
        base model's reserved special token ``<tool_call>`` has one): decoding skips their text,
        so the call parser is given it by id."""
        return self._special({i: tag for tag, i in self.tool_tags.items()})

    def opens_think(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt ends inside an open ``<think>`` (whitespace after it aside): the
        generation prompt of templates that start the model's turn thinking (DeepSeek-R1,
        Qwen3-Thinking-2507)."""
        tail: str = self._tok.decode(prompt_ids[-8:], skip_special_tokens=False)
        return tail.rstrip().endswith(THINK)

    def token_str(self, token_id: int) -> str:
        """A token's text for logprobs: decoded, or its vocabulary entry when it is only part of
        a character (decoding would give U+FFFD, the same for many tokens)."""
        text: str = self._tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            return self._tok.id_to_token(token_id) or text
        return text

    @property
    def raw(self) -> Tokenizer:
        """The ``tokenizers.Tokenizer`` itself (incremental decoding steps it directly)."""
        return self._tok

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return text


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas: ``tokenizers``' ``DecodeStream``,
    which keeps the few tokens of context a delta depends on (a character may span tokens; a
    leading space may depend on the previous token) and holds back an incomplete UTF-8
    sequence, so each token costs one short decode, never a re-decode of the text so far.

    It starts from the prompt's last tokens, so the first output token's text (a sentencepiece
    word's leading space) reads as it does after that prompt.
    """

    CONTEXT_TOKENS = 5
    __slots__ = ("_stream", "_tok")

    def __init__(self, tokenizer: ModelTokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer.raw
        self._stream = DecodeStream(ids=prompt_ids[-self.CONTEXT_TOKENS :], skip_special_tokens=skip_special_tokens)

    def push(self, token_id: int) -> str:
        return self._stream.step(self._tok, token_id) or ""


class StopStringMatcher:
    """Finds the first stop string in generated text and holds back text that may start one.

    ``feed(delta)`` returns ``(text_safe_to_send, stopped)``. While not stopped, the last
    ``longest-1`` characters are held back because they might be the start of a stop string;
    ``flush()`` releases them at the end of generation. Only that held-back window and the new
    delta are searched: a stop string ending in the delta starts at most ``longest-1``
    characters before it, and one ending earlier was found when its end arrived.
    """

    __slots__ = ("_held", "_hold", "_include", "_stops")

    def __init__(self, stops: list[str], include: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self._include = include  # vLLM's include_stop_str_in_output: the text ends with the stop string

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self._stops:
            return delta, False
        window = self._held + delta
        cut, end = -1, -1
        for stop in self._stops:
            i = window.find(stop)
            if i != -1 and (cut == -1 or i < cut):
                cut, end = i, i + len(stop)
        if cut != -1:
            self._held = ""
            return window[: end if self._include else cut], True
        release = len(window) - self._hold
        if release <= 0:
            self._held = window
            return "", False
        self._held = window[release:]
        return window[:release], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out
