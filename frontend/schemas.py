"""OpenAI request bodies, decoded and range-checked by msgspec in one pass.

Field constraints live in the types (``Meta``), so a bad value is rejected while decoding with
a message naming its JSON path; ``errors.from_validation`` turns that into OpenAI's error shape.
Unknown fields are ignored, as OpenAI's own server does.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

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
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = 0  # -1 and 0 both mean off
    min_tokens: NonNegInt = 0
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    n: PositiveInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Priority = 0
    user: str | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0  # vLLM's extension
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0  # vLLM's extension
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    # vLLM's extension: also return the prompt's and the output's token ids.
    return_token_ids: bool = False

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[TokenId]
    echo: bool = False
    suffix: str | None = None
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None


class PriorityUpdate(msgspec.Struct):
    priority: Priority
    cut_in: bool = False


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
