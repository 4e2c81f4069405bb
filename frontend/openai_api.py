"""``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``.

Each handler: decode and validate the body, tokenize, build an ``AddRequest``, then either stream
SSE chunks (one per token) or collect the whole answer. Validation is complete before anything
reaches the scheduler, so a client mistake is always a 4xx and never costs the engine a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.errors import APIError, bad_request
from frontend.generation import Delta, Generation
from frontend.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields, decode, message_text
from frontend.stall_guard import DroppingStreamingResponse
from frontend.state import AppState
from frontend.tokenizer import ChatTemplateError, ModelTokenizer, PromptTooLong
from protocol.messages import AddRequest, FinishReason, Logprob, SamplingParams

_json = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"


def _sse(obj: object) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def _json_response(body: object, request_id: str) -> Response:
    return Response(_json.encode(body), media_type="application/json", headers={"X-Request-Id": request_id})


async def _tokenize(size: int, encode: Callable[..., list[int]], *args: Any) -> list[int]:
    """``encode(*args)``; on a thread when the text is long (``size`` characters or so), so a
    long prompt does not stall the event loop (other streams, /health, the scheduler's pings)."""
    if size >= ModelTokenizer.GIL_FREE_CHARS:
        return await asyncio.to_thread(encode, *args)
    return encode(*args)


# ------------------------------------------------------------------------------------ validation


def _check_model(state: AppState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        shown = name if len(name) <= 100 else name[:100] + "..."
        raise APIError(404, f"The model `{shown}` does not exist; this server serves `{state.model_name}`.",
                       param="model", code="model_not_found")


def _check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    if ids and max(ids) >= vocab_size:  # max() runs in C; the scan below names the first bad id
        bad = next(t for t in ids if t >= vocab_size)
        raise bad_request(f"token id {bad} is out of vocabulary (vocab size {vocab_size})", param)


def _sampling(state: AppState, body: SamplingFields, prompt_len: int, max_tokens: int | None,
              logprobs: int | None, default_max_tokens: int | None,
              prompt_param: str = "prompt", max_tokens_param: str = "max_tokens") -> SamplingParams:
    """``prompt_param``, ``max_tokens_param``: the fields the prompt and ``max_tokens`` came from
    (errors name them)."""
    model = state.require_model()
    limit = model.max_model_len
    if prompt_len == 0:
        raise bad_request("the prompt is empty", prompt_param)
    if prompt_len >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens; the prompt has "
                          f"{prompt_len} tokens, leaving no room for output.", prompt_param)
    if max_tokens is None:
        max_tokens = default_max_tokens if default_max_tokens is not None else limit - prompt_len
    if prompt_len + max_tokens > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                          f"for the completion). Reduce the prompt or {max_tokens_param}.", max_tokens_param)
    capacity = model.num_kv_blocks * model.block_size
    if prompt_len + max_tokens > capacity:
        raise bad_request(f"prompt + max_tokens = {prompt_len + max_tokens} tokens exceeds the KV cache of this "
                          f"server ({capacity} tokens); lower {max_tokens_param}", max_tokens_param)
    if body.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({body.min_tokens}) must not exceed {max_tokens_param} ({max_tokens})",
                          "min_tokens")
    stop_ids = list(dict.fromkeys(body.stop_token_ids or []))
    _check_token_ids(stop_ids, model.vocab_size, "stop_token_ids")
    logit_bias = _logit_bias(body.logit_bias or {}, model.vocab_size)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        # top_k >= vocab keeps every token, as 0 does; sent as is, 2**63 killed the worker
        # (torch.tensor overflow) on every restart that recomputed it.
        top_k=body.top_k if 0 < body.top_k < model.vocab_size else 0,
        min_tokens=body.min_tokens,
        seed=body.seed,
        stop_token_ids=stop_ids,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=logit_bias,
    )


def _logit_bias(bias: dict[str, float], vocab_size: int) -> list[tuple[int, float]]:
    """OpenAI's ``{"token id": bias}`` as (id, bias) pairs; keys must be in-vocabulary ids. Keys
    naming the same id ("7", "007") count once, the last one winning, as a repeated JSON key does
    (the worker adds every pair it gets)."""
    by_token: dict[int, float] = {}
    for key, value in bias.items():
        token = _plain_token_id(key)
        if token is None or token >= vocab_size:
            shown = key if len(key) <= 40 else key[:40] + "..."
            raise bad_request(f"logit_bias key {shown!r} is not a token id of this model (vocab size {vocab_size})",
                              "logit_bias")
        by_token.pop(token, None)
        by_token[token] = float(value)
    return list(by_token.items())


def _plain_token_id(key: str) -> int | None:
    """``key`` as a token id when it is nothing but ASCII digits, else None. ``str.isdigit`` alone
    also accepts "²" (which ``int`` refuses) and other scripts' digits (which ``int`` reads), and
    ``int`` also accepts " 7", "+7" and "1_0"; the length bound keeps ``int`` clear of its
    4300-digit limit (no vocabulary is near 10**18)."""
    if not (key.isascii() and key.isdigit()):
        return None
    digits = key.lstrip("0") or "0"
    return int(digits) if len(digits) <= 18 else None


def _check_priority(state: AppState, request: Request, priority: int) -> None:
    if priority < 0 and not state.is_admin(request):
        raise APIError(403, "priority below 0 (more urgent than default) requires the admin token",
                       param="priority", code="priority_requires_admin")


def _check_capacity(state: AppState) -> None:
    if state.client.num_waiting_first_token >= state.config.max_queued_requests:
        raise APIError(503, "the server is overloaded: too many queued requests; retry later",
                       code="overloaded", headers={"Retry-After": "1"})


# ------------------------------------------------------------------------------------ running


ChunkFn = Callable[[Delta, bool, int], "dict[str, Any] | None"]
FinalFn = Callable[[str, str, Any, list[int], list[Logprob], int], "dict[str, Any]"]


async def _run(
    state: AppState,
    request: Request,
    body: SamplingFields,
    prompt_ids: list[int],
    sampling: SamplingParams,
    request_id: str,
    chunk: ChunkFn,
    final: FinalFn,
) -> Response:
    """Shared by both endpoints: ``chunk(delta, first, index)`` makes one SSE chunk body for
    choice ``index`` (or None to send nothing), ``final(text, finish_reason, usage, token_ids,
    logprobs, index)`` the non-streaming body of one choice; with ``n`` > 1 the choices are
    merged into one body.

    Choice i > 0 is its own engine request (id ``<request_id>-<i>``, seed + i when seeded) that
    waits for choice 0 to compute the prompt and then shares its KV blocks."""
    _check_capacity(state)
    tokenizer = state.require_tokenizer()
    gens: list[Generation] = []
    for i in range(body.n):
        choice_sampling = sampling
        if i and sampling.seed is not None:
            choice_sampling = msgspec.structs.replace(sampling, seed=(sampling.seed + i) % 2**63)
        add = AddRequest(
            rid=state.client.next_rid(),
            request_id=request_id if i == 0 else f"{request_id}-{i}",
            prompt_token_ids=prompt_ids,
            sampling=choice_sampling,
            priority=body.priority,
            user=body.user or "",
            arrival_time=time.time(),
            after=gens[0].rid if i else None,
        )
        gens.append(Generation(state.client, tokenizer, add, body.stop_strings(), state.metrics,
                               timeout=state.config.request_timeout))
    for gen in gens:
        await gen.start()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _stream(gens[0], chunk, include_usage, request_id) if len(gens) == 1 else \
            _stream_choices(gens, chunk, include_usage, request_id)
        return DroppingStreamingResponse(stream, state.config.client_stall_timeout, media_type="text/event-stream",
                                         headers={"X-Request-Id": request_id, "Cache-Control": "no-cache"})
    answers = await _collect_unless_disconnected(request, gens)
    usage = _usage(gens)
    bodies = [final(text, reason, usage, token_ids, entries, i)
              for i, (text, reason, token_ids, entries) in enumerate(answers)]
    merged = bodies[0]
    merged["choices"] = [_with_abort_reason(b["choices"][0], gen.abort_reason) for b, gen in zip(bodies, gens, strict=True)]
    return _json_response(merged, request_id)


def _with_abort_reason(choice: dict[str, Any], reason: str | None) -> dict[str, Any]:
    """A choice the server aborted (``--request-timeout``) says why, beside ``finish_reason``."""
    if reason is not None and choice.get("finish_reason") == FinishReason.ABORT:
        choice["abort_reason"] = reason
    return choice


def _usage(gens: list[Generation]) -> dict[str, object]:
    """One prompt, however many choices: its tokens count once, completions add up."""
    usage = dataclasses.replace(gens[0].usage, completion_tokens=sum(g.usage.completion_tokens for g in gens))
    return usage.as_dict()


async def _stream(gen: Generation, chunk: ChunkFn, include_usage: bool, request_id: str) -> AsyncIterator[bytes]:
    first = True
    async for delta in gen.deltas():
        if delta.error is not None:
            yield _error_chunk(delta.error)
            break
        body = chunk(delta, first, 0)
        first = False
        if body is not None:
            _with_abort_reason(body["choices"][0], delta.abort_reason)
            yield _sse(body)
    if include_usage:
        yield _sse({"id": request_id, "object": "usage", "choices": [], "usage": gen.usage.as_dict()})
    yield SSE_DONE


def _error_chunk(message: str) -> bytes:
    # Headers are gone already: the error travels as a chunk in OpenAI's error shape.
    return _sse({"error": {"message": message, "type": "service_unavailable", "param": None,
                           "code": "engine_error"}})


async def _stream_choices(gens: list[Generation], chunk: ChunkFn, include_usage: bool,
                          request_id: str) -> AsyncIterator[bytes]:
    """n > 1: every choice's chunks, interleaved as they come, each naming its ``index``."""
    arrived: asyncio.Queue[tuple[int, Delta | None, bool]] = asyncio.Queue()

    async def pump(index: int, gen: Generation) -> None:
        first = True
        try:
            async for delta in gen.deltas():
                arrived.put_nowait((index, delta, first))
                first = False
        finally:
            arrived.put_nowait((index, None, False))

    pumps = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(gens)]
    try:
        running = len(gens)
        while running:
            index, delta, first = await arrived.get()
            if delta is None:
                running -= 1
                continue
            if delta.error is not None:
                yield _error_chunk(delta.error)
                break
            body = chunk(delta, first, index)
            if body is not None:
                _with_abort_reason(body["choices"][0], delta.abort_reason)
                yield _sse(body)
        if include_usage:
            yield _sse({"id": request_id, "object": "usage", "choices": [], "usage": _usage(gens)})
        yield SSE_DONE
    finally:
        # A client gone mid-stream: cancelling each pump aborts its request (Generation's finally).
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _collect(gen: Generation) -> tuple[str, str, list[int], list[Logprob]]:
    parts: list[str] = []
    token_ids: list[int] = []
    entries: list[Logprob] = []
    reason = FinishReason.ABORT
    async for delta in gen.deltas():
        if delta.error is not None:
            raise APIError(503, delta.error, code="engine_error")
        parts.append(delta.text)
        token_ids += delta.token_ids
        entries += delta.logprobs
        if delta.finish_reason is not None:
            reason = delta.finish_reason
    return "".join(parts), reason, token_ids, entries


async def _collect_unless_disconnected(request: Request, gens: list[Generation]
                                       ) -> list[tuple[str, str, list[int], list[Logprob]]]:
    """Collect every choice, but give up (aborting the requests) if the client disconnects."""
    collect = asyncio.ensure_future(asyncio.gather(*(_collect(gen) for gen in gens)))
    disconnect = asyncio.ensure_future(_wait_disconnect(request))
    either: list[asyncio.Future[Any]] = [collect, disconnect]
    try:
        done, _ = await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not collect.done():
            collect.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await disconnect
        with contextlib.suppress(asyncio.CancelledError, APIError):
            await collect  # let cancelled collectors finish their clean-up (the aborts)
    if collect not in done:
        # The client went first. (Not ``collect.cancelled()``: a cancelled gather reports its
        # children's CancelledError as its exception, which then escaped as a 500 and a traceback.)
        raise APIError(400, "client disconnected")  # nobody reads this response
    return collect.result()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ------------------------------------------------------------------------------------ endpoints


async def completions(request: Request) -> Response:
    state: AppState = request.app.state.sluice
    body: CompletionRequest = decode(await request.body(), CompletionRequest)
    tokenizer = state.require_tokenizer()
    _check_model(state, body.model)
    _check_priority(state, request, body.priority)
    if body.echo:
        raise bad_request("echo is not supported", "echo")
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if not body.prompt:
        raise bad_request("the prompt is empty", "prompt")
    if isinstance(body.prompt, str):
        max_chars = tokenizer.max_text_chars(state.require_model().max_model_len - 1)
        try:
            prompt_ids = await _tokenize(len(body.prompt), tokenizer.encode_prompt, body.prompt, max_chars)
        except PromptTooLong as e:
            raise bad_request(str(e), "prompt") from None
    else:
        prompt_ids = list(body.prompt)
    # The length checks come before the id check: a million ids is refused for its length.
    sampling = _sampling(state, body, len(prompt_ids), body.max_tokens, body.logprobs, default_max_tokens=16)
    _check_token_ids(prompt_ids, tokenizer.vocab_size, "prompt")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = state.model_name

    offsets = [0] * body.n  # text offset of each choice's next token, for logprobs

    def completion_logprobs(delta_ids: list[int], entries: list[Logprob], texts: list[str],
                            index: int) -> dict[str, Any] | None:
        if body.logprobs is None or not delta_ids:
            return None
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entry, text in zip(delta_ids, entries, texts, strict=True):
            out["tokens"].append(tokenizer.token_str(tid))
            out["token_logprobs"].append(entry[0] if entry else None)
            out["top_logprobs"].append({tokenizer.token_str(t): lp
                                        for t, lp in zip(entry[1], entry[2], strict=True)} if entry else None)
            out["text_offset"].append(offsets[index])
            offsets[index] += len(text)
        return out

    def chunk(delta: Delta, first: bool, index: int) -> dict[str, Any]:
        choice = {"index": index, "text": delta.text, "finish_reason": delta.finish_reason,
                  "logprobs": completion_logprobs(delta.token_ids, delta.logprobs, [delta.text], index)}
        if body.return_token_ids:
            choice["token_ids"] = delta.token_ids
            if first:
                choice["prompt_token_ids"] = prompt_ids
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": [choice]}

    def final(text: str, reason: str, usage: Any, token_ids: list[int], entries: list[Logprob],
              index: int) -> dict[str, Any]:
        texts = [tokenizer.decode([t]) for t in token_ids]
        choice = {"index": index, "text": text, "finish_reason": reason,
                  "logprobs": completion_logprobs(token_ids, entries, texts, index)}
        if body.return_token_ids:
            choice.update(token_ids=token_ids, prompt_token_ids=prompt_ids)
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": [choice], "usage": usage}

    return await _run(state, request, body, prompt_ids, sampling, request_id, chunk, final)


def _check_unsupported_chat_fields(body: ChatCompletionRequest) -> None:
    """OpenAI fields Sluice does not act on: refused when they ask for something, so a client
    never takes plain text for the tool call or JSON it asked for."""
    if body.tools:
        raise bad_request("tools (function calling) is not supported", "tools")
    if body.tool_choice not in (None, "none", "auto"):
        raise bad_request("tool_choice is not supported (no tools)", "tool_choice")
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        raise bad_request("response_format other than text (JSON mode, structured outputs) is not supported",
                          "response_format")


async def chat_completions(request: Request) -> Response:
    state: AppState = request.app.state.sluice
    body: ChatCompletionRequest = decode(await request.body(), ChatCompletionRequest)
    _check_unsupported_chat_fields(body)
    tokenizer: ModelTokenizer = state.require_tokenizer()
    _check_model(state, body.model)
    _check_priority(state, request, body.priority)
    try:
        messages = [{"role": m.role, "content": message_text(m)} for m in body.messages]
        max_chars = tokenizer.max_text_chars(state.require_model().max_model_len - 1)
        size = sum(len(m["role"]) + len(m["content"]) for m in messages)
        prompt_ids = await _tokenize(size, tokenizer.encode_chat, messages, max_chars)
    except (ValueError, ChatTemplateError) as e:  # PromptTooLong is a ValueError too
        raise bad_request(str(e), "messages") from None
    max_tokens, max_tokens_param = (body.max_completion_tokens, "max_completion_tokens") \
        if body.max_completion_tokens is not None else (body.max_tokens, "max_tokens")
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    sampling = _sampling(state, body, len(prompt_ids), max_tokens, top_logprobs, default_max_tokens=None,
                         prompt_param="messages", max_tokens_param=max_tokens_param)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = state.model_name

    def chat_logprobs(delta_ids: list[int], entries: list[Logprob]) -> dict[str, Any] | None:
        if top_logprobs is None or not delta_ids:
            return None

        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = tokenizer.token_str(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for tid, entry in zip(delta_ids, entries, strict=True):
            if entry is None:
                continue
            content.append(item(tid, entry[0]) | {
                "top_logprobs": [item(t, lp) for t, lp in zip(entry[1], entry[2], strict=True)]})
        return {"content": content}

    def chunk(delta: Delta, first: bool, index: int) -> dict[str, Any]:
        message: dict[str, Any] = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        if first:
            message = {"role": "assistant", "content": delta.text}
        return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": message, "logprobs": chat_logprobs(delta.token_ids, delta.logprobs),
                             "finish_reason": delta.finish_reason}]}

    def final(text: str, reason: str, usage: Any, token_ids: list[int], entries: list[Logprob],
              index: int) -> dict[str, Any]:
        choice = {"index": index, "message": {"role": "assistant", "content": text},
                  "logprobs": chat_logprobs(token_ids, entries), "finish_reason": reason}
        if body.return_token_ids:
            choice.update(token_ids=token_ids, prompt_token_ids=prompt_ids)
        return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "usage": usage}

    return await _run(state, request, body, prompt_ids, sampling, request_id, chunk, final)


async def list_models(request: Request) -> Response:
    state: AppState = request.app.state.sluice
    model = state.client.model
    data = []
    if model is not None:
        data.append({"id": state.model_name, "object": "model", "created": state.started,
                     "owned_by": "sluice", "max_model_len": model.max_model_len})
    return Response(_json.encode({"object": "list", "data": data}), media_type="application/json")
