"""OpenAI request bodies, decoded and range-checked by msgspec in one pass.

Field constraints live in the types (``Meta``), so a bad value is rejected while decoding with
a message naming its JSON path; ``errors.from_validation`` turns that into OpenAI's error shape.
A top-level field the API does not know is refused naming it, as OpenAI's API refuses it
("Unrecognized request argument supplied: temprature"): a misspelt option silently ignored is a
request that does something else than its sender thinks. OpenAI fields Sluice does not act on
are either ignored where ignoring them changes nothing (``store``, ``metadata``, …) or refused
as not supported when set (``tools``, …).

Lists and maps that cost the engine work per generated token are capped (``stop``,
``stop_token_ids``, ``logit_bias``), and so is ``n``; ``decode`` turns every way a body can fail
to decode (malformed JSON, invalid UTF-8, nesting deeper than msgspec recurses) into a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from frontend.errors import bad_request, from_decode_error

MAX_N = 128  # choices per request
MAX_PROMPTS = 1024  # prompts of one completion request (a batch, as OpenAI's and vLLM's APIs take)
MAX_CHOICES = 1024  # prompts x n: the engine requests one completion request may make
MAX_STOP = 64  # stop strings: each is searched for in the text after every token
MAX_STOP_TOKEN_IDS = 1024  # the scheduler and the worker test every token against the list
MAX_LOGIT_BIAS = 1024  # entries: the worker adds each one on every step
MAX_USER_CHARS = 256  # `user` travels with the request to the scheduler and into the logs

T = TypeVar("T")

# OpenAI's defaults (vLLM's for its extensions), where neither the request nor the model says.
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
TokenId = Annotated[int, Meta(ge=0)]
Temperature = Annotated[float, Meta(ge=0.0, le=100.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Priority = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    # Sampling fields left unset (None) take the model's defaults, else OpenAI's (``SAMPLING_DEFAULTS``).
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None  # -1, 0 and the vocabulary size or more all mean off
    min_tokens: NonNegInt = 0
    seed: Seed | None = None
    stop: str | Annotated[list[str], Meta(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Priority = 0
    user: Annotated[str, Meta(max_length=MAX_USER_CHARS)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None  # vLLM's extension
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None  # vLLM's extension
    logit_bias: Annotated[dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]],
                          Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    # vLLM's extension: also return the prompt's and the output's token ids.
    return_token_ids: bool = False
    # vLLM's extension: score every prompt token, with this many alternatives each.
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    # vLLM's extensions: special tokens' text in the output; a matched stop string kept in it.
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured output (``frontend/structured.py``): OpenAI's, vLLM's, and vLLM's older aliases.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def guided(self) -> dict[str, Any]:
        return {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar}

    def sampling_field(self, name: str, model_defaults: dict[str, float]) -> float:
        """A sampling field as set by the request, else the model's default, else OpenAI's."""
        value = getattr(self, name)
        if value is not None:
            return float(value)
        return model_defaults.get(name, SAMPLING_DEFAULTS[name])

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    # A text, a list of token ids, or a batch of either (``prompts``).
    prompt: str | list[Any]
    echo: bool = False
    suffix: str | None = None
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    best_of: Annotated[int, Meta(ge=1, le=1)] | None = None  # OpenAI's; only 1 (the default) is served

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or a batch, each a text or token ids, as OpenAI's API reads ``prompt``:
        a string, a list of token ids, a list of strings, or a list of lists of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise bad_request("the prompt is empty", "prompt")
        if all(type(t) is int for t in prompt):
            _check_ids(prompt, "prompt")
            return [prompt]
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts in one request; this one has {len(prompt)}", "prompt")
        if len(prompt) * self.n > MAX_CHOICES:
            raise bad_request(f"{len(prompt)} prompts x n = {self.n} is {len(prompt) * self.n} choices; at most "
                              f"{MAX_CHOICES} in one request", "n")
        for i, item in enumerate(prompt):
            if isinstance(item, list) and all(type(t) is int for t in item):
                _check_ids(item, f"prompt[{i}]")
            elif not isinstance(item, str):
                raise bad_request("prompt must be a string, a list of token ids, or a list of either (a batch); "
                                  f"prompt[{i}] is neither", f"prompt[{i}]")
        return list(prompt)


def _check_ids(ids: list[int], param: str) -> None:
    bad = next((i for i, t in enumerate(ids) if t < 0), None)
    if bad is not None:
        raise bad_request(f"token ids are never negative; {param}[{bad}] is {ids[bad]}", param)


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """A field Sluice cannot render is refused naming it, never dropped: an assistant turn whose
    tool call vanished would be an empty turn, and the model's answer nonsense."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (``frontend/tools.py`` renders them)
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: Any = None  # OpenAI's deprecated single call: refused by name
    refusal: str | None = None
    # An earlier answer's think block, as this server (SGLang, DeepSeek) returns it, or as vLLM
    # names it: templates of thinking models (Qwen3) render it back for the turns they keep it in.
    reasoning_content: str | None = None
    reasoning: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """What the chat template reads of it."""
        out: dict[str, Any] = {"role": self.role, "content": message_text(self)}
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thought is not None:
            out["reasoning_content"] = thought
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def unsupported_message_fields(messages: list[ChatMessage]) -> tuple[str, str] | None:
    """(param, message) for the first message Sluice cannot render as asked: a role other than
    ``CHAT_ROLES``, OpenAI's deprecated ``function`` role or ``function_call``, a tool message
    without the call it answers, or an assistant's call that is not a function call."""
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role == "function" or m.function_call is not None:
            param = f"{where}.role" if m.role == "function" else f"{where}.function_call"
            return param, f"{param}: OpenAI's deprecated function calling is not supported; use tools and tool_calls"
        if m.role not in CHAT_ROLES:
            return f"{where}.role", f"{where}: unknown role {m.role!r}; expected one of {', '.join(CHAT_ROLES)}"
        if m.role == "tool" and not m.tool_call_id:
            return f"{where}.tool_call_id", f"{where}: a tool message needs the tool_call_id of the call it answers"
        for j, call in enumerate(m.tool_calls or []):
            fn = call.get("function") if isinstance(call, dict) else None
            if m.role != "assistant" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                return (f"{where}.tool_calls[{j}]", f"{where}.tool_calls[{j}] must be an assistant's "
                        '{"type": "function", "function": {"name", "arguments"}}')
    return None


class ChatCompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    # OpenAI's fields Sluice does not act on. Accepted where that changes nothing:
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # Tool calling (``frontend/tools.py`` checks them, naming the field):
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's extension: more variables for the chat template (``{"enable_thinking": false}``).
    chat_template_kwargs: dict[str, Any] | None = None
    # A thinking model's answer (``frontend/reasoning.py``): OpenAI's effort (none turns thinking
    # off where the template can), and SGLang's switch to leave the think block in the content.
    reasoning_effort: str | None = None
    separate_reasoning: bool = True


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``/tokenize`` body: a completion ``prompt`` or chat ``messages`` (exactly one)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    tools: list[Any] | None = None  # messages only: as chat completions show them to the model
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # messages only, as chat completions take it
    add_special_tokens: bool = True  # prompt only: the BOS the model expects, as completions add it


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[TokenId]


class PriorityUpdate(msgspec.Struct, forbid_unknown_fields=True):
    # Sluice's own body, so a misspelt field is an error; and an unknown field is refused before
    # msgspec walks its value (a deeply nested one would exhaust its recursion limit).
    priority: Priority
    cut_in: bool = False


_decoders: dict[type, msgspec.json.Decoder[Any]] = {}


def decode(raw: bytes, cls: type[T]) -> T:
    """``raw`` decoded as ``cls``, or an ``APIError`` (400) saying why not, naming the field
    where msgspec can. Invalid UTF-8 anywhere is refused first (msgspec raises UnicodeDecodeError
    in the strings it reads, and skips unknown fields unread); JSON nested deeper than Python's
    recursion limit (about 950 levels under the server) is refused too."""
    decoder = _decoders.get(cls) or _decoders.setdefault(cls, msgspec.json.Decoder(cls))
    if not raw.isascii():
        try:
            raw.decode()
        except UnicodeDecodeError as e:
            raise bad_request(f"request body is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    try:
        result: T = decoder.decode(raw)
    except msgspec.DecodeError as e:
        raise from_decode_error(e) from None
    except RecursionError:
        raise bad_request("request body is nested too deeply to decode") from None
    return result


def message_text(message: ChatMessage) -> str:
    """The text of a chat message; content parts of type ``text`` are concatenated."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError("only content parts of type 'text' are supported")
        parts.append(part["text"])
    return "".join(parts)
