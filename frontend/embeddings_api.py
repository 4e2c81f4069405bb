"""``POST /v1/embeddings``: the served model's final hidden states of each input, pooled.

As vLLM serves a decoder model's embeddings: each input is tokenized as a completion prompt is,
computed as prompt-only work through the scheduler (batched with other prefills, counted in the
token budget, its KV blocks freed when it ends), and its last token's final hidden state (or the
mean over its tokens: ``--pooling``), L2-normalised, is the vector. No text is generated: the
scheduler ends each input after its prompt (one output step, whose token is dropped).
"""

from __future__ import annotations

import array
import base64
import contextlib
import sys
import time
import uuid
from typing import Annotated, Any

import msgspec
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response

from frontend.errors import APIError, bad_request
from frontend.openai_api import (
    check_capacity,
    check_model,
    check_priority,
    check_token_ids,
    json_response,
    tokenize_off_loop,
)
from frontend.output import Output
from frontend.render import Piece
from frontend.schemas import MAX_PROMPTS, MAX_USER_CHARS, Priority, decode
from frontend.sse import collect_all
from frontend.state import AppState
from frontend.tokenizer import PromptTooLong
from protocol.messages import AddRequest, Logprob, PromptLogprob, SamplingParams


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # A text, a list of token ids, or a batch of either (at most MAX_PROMPTS inputs).
    input: str | list[Any]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: Annotated[str, Meta(max_length=MAX_USER_CHARS)] | None = None
    priority: Priority = 0  # Sluice's, as on the other endpoints



def _floats(little_endian_f32: bytes) -> list[float]:
    """The float32 vector as JSON numbers (the standard library's array: numpy would cost the
    frontend 10 MiB of memory for this one call)."""
    values = array.array("f", little_endian_f32)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _inputs(body: EmbeddingRequest) -> list[str | list[int]]:
    """``input`` as a list of texts or token-id lists (OpenAI's four shapes)."""
    value = body.input
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request("input is empty", "input")
    if all(type(t) is int for t in value):
        return [value]
    if len(value) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} inputs in one request; this one has {len(value)}", "input")
    for i, item in enumerate(value):
        if not (isinstance(item, str) or (isinstance(item, list) and all(type(t) is int for t in item))):
            raise bad_request("input must be a string, a list of token ids, or a list of either; "
                              f"input[{i}] is neither", f"input[{i}]")
    return list(value)


class _NoText:
    """What an embedding request's ``Output`` renders: nothing (it never streams, and its answer
    is its vector, read by the handler)."""

    endpoint = "/v1/embeddings"
    plain = False
    stream_end = b""

    def token(self, choice: Piece, text: str, reasoning: bool = False) -> bytes:
        raise AssertionError("an embedding request has no text")

    def chunk(self, choice: Piece, text: str, token_ids: list[int], logprobs: list[Logprob],
              finish_reason: str | None, abort_reason: str | None, reasoning: str = "") -> bytes:
        raise AssertionError("an embedding request has no text")

    def answer(self, choice: Piece, text: str, token_ids: list[int], logprobs: list[Logprob],
               finish_reason: str, abort_reason: str | None, reasoning: str | None = None) -> dict[str, Any]:
        raise AssertionError("an embedding request has no text")

    def body(self, choices: list[dict[str, Any]], usage: dict[str, object],
             prompt_logprobs: list[PromptLogprob] | None = None) -> dict[str, Any]:
        raise AssertionError("an embedding request has no text")

    def usage_chunk(self, usage: dict[str, object]) -> bytes:
        return b""

    def error(self, message: str, code: str) -> bytes:
        return b""


async def embeddings(request: Request) -> Response:
    state: AppState = request.app.state.sluice
    body: EmbeddingRequest = decode(await request.body(), EmbeddingRequest)
    tokenizer = state.require_tokenizer()
    model = state.require_model()
    check_model(state, body.model)
    check_priority(state, request, body.priority)
    if body.encoding_format not in ("float", "base64"):
        raise bad_request(f"encoding_format must be float or base64, got {body.encoding_format!r}",
                          "encoding_format")
    hidden_size = model.hidden_size
    if body.dimensions is not None and body.dimensions != hidden_size:
        raise bad_request(f"dimensions: this model's embeddings have {hidden_size} dimensions and cannot be "
                          "shortened (it was not trained for it)", "dimensions")
    inputs = _inputs(body)
    # An input computes its prompt and one more position (the step that ends it).
    limit = min(model.max_model_len, model.num_kv_blocks * model.block_size) - 1
    max_chars = tokenizer.max_text_chars(limit)
    prompts: list[list[int]] = []
    for i, item in enumerate(inputs):
        param = "input" if len(inputs) == 1 else f"input[{i}]"
        if isinstance(item, str):
            if not item:
                raise bad_request("the input is empty", param)
            try:
                ids = await tokenize_off_loop(len(item), tokenizer.encode_prompt, item, max_chars)
            except PromptTooLong as e:
                raise bad_request(str(e), param) from None
        else:
            ids = list(item)
            if not ids:
                raise bad_request("the input is empty", param)
            if min(ids) < 0:
                raise bad_request("token ids are never negative", param)
        if len(ids) > limit:
            raise bad_request(f"the input has {len(ids)} tokens; this server embeds at most {limit} (the model's "
                              "context, or its KV cache, less one)", param)
        check_token_ids(ids, tokenizer.vocab_size, param)
        prompts.append(ids)
    check_capacity(state)
    request_id = f"embd-{uuid.uuid4().hex}"
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, pooling=state.config.pooling)
    renderer = _NoText()
    outputs = []
    for p, ids in enumerate(prompts):
        add = AddRequest(rid=state.client.next_rids(1), request_id=request_id if p == 0 else f"{request_id}-p{p}",
                         prompt_token_ids=ids, sampling=sampling, priority=body.priority, user=body.user or "",
                         arrival_time=time.time())
        outputs.append(Output(add, tokenizer, [], renderer, streaming=False, include_usage=False))
    async with contextlib.AsyncExitStack() as stack:  # leaving it aborts whatever still runs
        for output in outputs:
            await stack.enter_async_context(await state.client.add(output))
        await collect_all(outputs, request.receive)
    data = []
    for i, output in enumerate(outputs):
        if output.embedding is None:  # ended before its prompt was computed (aborted)
            reason = output.abort_reason or "the request was aborted"
            raise APIError(503, f"input {i} was not embedded: {reason}", code="aborted")
        vector: str | list[float] = base64.b64encode(output.embedding).decode() \
            if body.encoding_format == "base64" else _floats(output.embedding)
        data.append({"object": "embedding", "index": i, "embedding": vector})
    tokens = sum(len(ids) for ids in prompts)
    return json_response({"object": "list", "data": data, "model": state.model_name,
                           "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, request_id)
