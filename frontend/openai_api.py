"""``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``.

Each handler: decode and validate the body, tokenize, build an ``AddRequest`` and the renderer
of its answers, then either stream SSE chunks (one per token) or collect the whole answer; the
output processor (``frontend.output``) does the per-token work. Validation is complete before
anything reaches the scheduler, so a client mistake is always a 4xx and never costs the engine a
step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.errors import APIError, bad_request
from frontend.output import Output, TextOptions
from frontend.render import ChatRenderer, CompletionRenderer, Renderer, usage_dict
from frontend.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
    decode,
    unsupported_message_fields,
)
from frontend.sse import BatchStreamResponse, StreamResponse, collect, collect_all
from frontend.state import AppState
from frontend.structured import Constraint, constraint_of
from frontend.tokenizer import ChatTemplateError, ModelTokenizer, PromptTooLong
from frontend.tools import ToolUse, calls_constraint, prompt_messages, tool_use
from protocol.messages import AddRequest, SamplingParams

_json = msgspec.json.Encoder()


def json_response(body: object, request_id: str) -> Response:
    return Response(_json.encode(body), media_type="application/json", headers={"X-Request-Id": request_id})


async def tokenize_off_loop(size: int, encode: Callable[..., list[int]], *args: Any) -> list[int]:
    """``encode(*args)``; on a thread when the text is long (``size`` characters or so), so a
    long prompt does not stall the event loop (other streams, /health, the scheduler's pings)."""
    if size >= ModelTokenizer.GIL_FREE_CHARS:
        return await asyncio.to_thread(encode, *args)
    return encode(*args)


# ------------------------------------------------------------------------------------ validation


def check_model(state: AppState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        shown = name if len(name) <= 100 else name[:100] + "..."
        raise APIError(404, f"The model `{shown}` does not exist; this server serves `{state.model_name}`.",
                       param="model", code="model_not_found")


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    if ids and max(ids) >= vocab_size:  # max() runs in C; the scan below names the first bad id
        bad = next(t for t in ids if t >= vocab_size)
        raise bad_request(f"token id {bad} is out of vocabulary (vocab size {vocab_size})", param)


async def constraint_grammar(state: AppState, body: SamplingFields, calls: Constraint | None = None) -> str | None:
    """The request's structured-output grammar, validated (a 400 naming the field if it cannot
    be used); None when it asks for free text. ``calls``: a tool choice's grammar of calls."""
    constraint = constraint_of(body.response_format, body.structured_outputs, body.guided())
    if calls is not None and constraint is not None:
        raise bad_request(f"tool_choice requires tool calls and {constraint.param} constrains the output too: "
                          "give one (or tool_choice auto)", constraint.param)
    constraint = constraint or calls
    if constraint is None:
        return None
    if body.ignore_eos:
        raise bad_request(f"ignore_eos cannot be combined with {constraint.param}: a constrained output ends "
                          "where its grammar does", "ignore_eos")
    if body.min_tokens:
        raise bad_request(f"min_tokens cannot be combined with {constraint.param}: the grammar decides where the "
                          "output may end", "min_tokens")
    await state.grammars.validate(constraint, state.require_model())
    return constraint.grammar


def sampling_params(state: AppState, body: SamplingFields, prompt_len: int, max_tokens: int | None,
              logprobs: int | None, default_max_tokens: int | None, grammar: str | None = None,
              prompt_param: str = "prompt", max_tokens_param: str = "max_tokens",
              prompt_logprobs: int | None = None) -> SamplingParams:
    """``prompt_param``, ``max_tokens_param``: the fields the prompt and ``max_tokens`` came from
    (errors name them)."""
    model = state.require_model()
    limit = model.max_model_len
    if prompt_len == 0:
        raise bad_request("the prompt is empty", prompt_param)
    if prompt_len >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens; the prompt has "
                          f"{prompt_len} tokens, leaving no room for output.", prompt_param)
    capacity = model.num_kv_blocks * model.block_size
    if max_tokens is None:
        # Unset (chat): whatever fits, as vLLM does — the context's rest, or the KV cache's if
        # that is smaller (a request cannot hold more KV than the whole cache).
        if prompt_len >= capacity:
            raise bad_request(f"the prompt has {prompt_len} tokens; the KV cache of this server holds "
                              f"{capacity}, leaving no room for output", prompt_param)
        max_tokens = default_max_tokens if default_max_tokens is not None else min(limit, capacity) - prompt_len
    if prompt_len + max_tokens > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                          f"for the completion). Reduce the prompt or {max_tokens_param}.", max_tokens_param)
    if prompt_len + max_tokens > capacity:
        raise bad_request(f"prompt + max_tokens = {prompt_len + max_tokens} tokens exceeds the KV cache of this "
                          f"server ({capacity} tokens); lower {max_tokens_param}", max_tokens_param)
    if body.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({body.min_tokens}) must not exceed {max_tokens_param} ({max_tokens})",
                          "min_tokens")
    defaults = model.sampling_defaults
    top_k = int(body.sampling_field("top_k", defaults))
    stop_ids = list(dict.fromkeys(body.stop_token_ids or []))
    check_token_ids(stop_ids, model.vocab_size, "stop_token_ids")
    logit_bias = _logit_bias(body.logit_bias or {}, model.vocab_size)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.sampling_field("temperature", defaults),
        top_p=body.sampling_field("top_p", defaults),
        # top_k >= vocab keeps every token, as 0 does; sent as is, 2**63 killed the worker
        # (torch.tensor overflow) on every restart that recomputed it.
        top_k=top_k if 0 < top_k < model.vocab_size else 0,
        min_tokens=body.min_tokens,
        seed=body.seed,
        stop_token_ids=stop_ids,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        min_p=body.sampling_field("min_p", defaults),
        repetition_penalty=body.sampling_field("repetition_penalty", defaults),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=logit_bias,
        grammar=grammar,
        prompt_logprobs=prompt_logprobs,
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


def check_priority(state: AppState, request: Request, priority: int) -> None:
    if priority < 0 and not state.is_admin(request):
        raise APIError(403, "priority below 0 (more urgent than default) requires the admin token",
                       param="priority", code="priority_requires_admin")


def check_capacity(state: AppState) -> None:
    if state.client.num_waiting_first_token >= state.config.max_queued_requests:
        raise APIError(503, "the server is overloaded: too many queued requests; retry later",
                       code="overloaded", headers={"Retry-After": "1"})


# ------------------------------------------------------------------------------------ running


def engine_output(state: AppState, body: SamplingFields, prompt_ids: list[int], sampling: SamplingParams,
            request_id: str, renderer: Renderer, first_index: int = 0, terminal: bool = True,
            reasoning: bool | None = None, tools: bool = False) -> Output:
    """One prompt's engine request (its ``n`` choices, sent as one message) and the ``Output``
    its answers are rendered into (``reasoning``, ``tools``: ``Output``'s)."""
    add = AddRequest(
        rid=state.client.next_rids(body.n),
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        priority=body.priority,
        user=body.user or "",
        arrival_time=time.time(),
        n=body.n,
    )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    text = TextOptions(body.skip_special_tokens, body.include_stop_str_in_output)
    return Output(add, state.require_tokenizer(), body.stop_strings(), renderer, body.stream, include_usage,
                  first_index, terminal, text, reasoning, tools)


async def _run(state: AppState, request: Request, body: SamplingFields, prompt_ids: list[int],
               sampling: SamplingParams, request_id: str, renderer: Renderer,
               reasoning: bool | None = None, tools: bool = False) -> Response | StreamResponse:
    """Shared by both endpoints: one engine request per choice (``n``, sent as one message),
    their output rendered by ``renderer`` as it arrives — streamed as SSE chunks, or collected
    into one body."""
    check_capacity(state)
    output = engine_output(state, body, prompt_ids, sampling, request_id, renderer, reasoning=reasoning, tools=tools)
    handle = await state.client.add(output)
    if body.stream:
        return StreamResponse(handle, {"X-Request-Id": request_id})
    await collect(handle, request.receive)
    return json_response(output.body(), request_id)


async def _run_batch(state: AppState, request: Request, body: CompletionRequest,
                     prompts: list[tuple[list[int], SamplingParams, Renderer]],
                     request_id: str) -> Response | BatchStreamResponse:
    """Several prompts in one completion request: one engine request each, run together, their
    choices numbered across the prompts (prompt p's choice j is ``p * n + j``), in one body or
    one stream."""
    check_capacity(state)
    outputs = [engine_output(state, body, ids, sampling, request_id if p == 0 else f"{request_id}-p{p}", renderer,
                       first_index=p * body.n, terminal=False) for p, (ids, sampling, renderer) in enumerate(prompts)]

    def usage() -> dict[str, object]:
        return usage_dict(sum(len(output.request.prompt_token_ids) for output in outputs),
                          sum(c.completion_tokens for output in outputs for c in output.choices),
                          sum(output.choices[0].cached_tokens for output in outputs))

    renderer = prompts[0][2]
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    async with contextlib.AsyncExitStack() as stack:  # leaving it aborts what still runs
        handles = [await stack.enter_async_context(await state.client.add(output)) for output in outputs]
        if body.stream:
            stack.pop_all()  # the stream's writer holds them from now on
            return BatchStreamResponse(handles, {"X-Request-Id": request_id},
                                       lambda: renderer.usage_chunk(usage()) if include_usage else b"")
        await collect_all(outputs, request.receive)
    return json_response(renderer.body([answer for output in outputs for answer in output.answers()], usage()),
                          request_id)


# ------------------------------------------------------------------------------------ endpoints


async def completions(request: Request) -> Response | StreamResponse | BatchStreamResponse:
    state: AppState = request.app.state.sluice
    body: CompletionRequest = decode(await request.body(), CompletionRequest)
    tokenizer = state.require_tokenizer()
    check_model(state, body.model)
    check_priority(state, request, body.priority)
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    prompts = body.prompts()
    grammar = await constraint_grammar(state, body)
    # Echo with logprobs, or vLLM's prompt_logprobs: the worker scores every prompt token too.
    asked = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
    prompt_logprobs = max(asked) if asked else None
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    runs: list[tuple[list[int], SamplingParams, Renderer]] = []
    for p, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{p}]"
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("the prompt is empty", param)
            max_chars = tokenizer.max_text_chars(state.require_model().max_model_len - 1)
            try:
                prompt_ids = await tokenize_off_loop(len(prompt), tokenizer.encode_prompt, prompt, max_chars)
            except PromptTooLong as e:
                raise bad_request(str(e), param) from None
        else:
            prompt_ids = list(prompt)
        # The length checks come before the id check: a million ids is refused for its length.
        sampling = sampling_params(state, body, len(prompt_ids), body.max_tokens, body.logprobs, default_max_tokens=16,
                             grammar=grammar, prompt_param=param, prompt_logprobs=prompt_logprobs)
        check_token_ids(prompt_ids, tokenizer.vocab_size, param)
        renderer = CompletionRenderer(request_id, created, state.model_name, tokenizer, prompt_ids,
                                      body.return_token_ids, body.logprobs, echo=body.echo,
                                      prompt_logprobs=body.prompt_logprobs,
                                      prompt_text=prompt if isinstance(prompt, str) else None)
        runs.append((prompt_ids, sampling, renderer))
    if len(runs) == 1:
        ids, sampling, only = runs[0]
        return await _run(state, request, body, ids, sampling, request_id, only)
    return await _run_batch(state, request, body, runs, request_id)


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's


def thinking_kwargs(kwargs: dict[str, Any] | None, effort: str | None, splits: bool,
                    param: str) -> dict[str, Any] | None:
    """The chat template's variables: the request's own (``chat_template_kwargs``, which win),
    and what a reasoning effort asks for. ``none`` renders the template with ``enable_thinking``
    false (Qwen3's switch); every effort is given to it as ``reasoning_effort`` (what templates
    that take an effort read). A model that writes no reasoning (``splits`` false) honours only
    none; asking it for more is a 400 naming ``param``."""
    if effort is None:
        return kwargs
    if effort not in REASONING_EFFORTS:
        raise bad_request(f"{param} must be one of {', '.join(REASONING_EFFORTS)}; got {effort[:40]!r}", param)
    if effort != "none" and not splits:
        raise bad_request(f"{param} {effort!r}: the served model writes no reasoning (its tokenizer has no "
                          "<think> and </think>, or the server runs with --reasoning-parser none); leave it "
                          "unset or none", param)
    asked: dict[str, Any] = {"reasoning_effort": effort}
    if effort == "none":
        asked["enable_thinking"] = False
    return asked | (kwargs or {})


def starts_thinking(tokenizer: ModelTokenizer, prompt_ids: list[int], grammar: str | None) -> bool:
    """Whether a split answer starts inside the think block (``frontend.reasoning``): the
    prompt left ``<think>`` open, and no grammar shapes the output. A grammar's output is what
    it allows from the first token on (JSON, tool calls), so it is content unless it opens a
    block itself; the model cannot think first."""
    return grammar is None and tokenizer.opens_think(prompt_ids)


async def chat_prompt_ids(tokenizer: ModelTokenizer, messages: list[ChatMessage], use: ToolUse | None,
                          max_chars: int | None = None, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The conversation rendered with the chat template and tokenized (a 400 naming the message
    it cannot render). The template is given the tools when it renders them itself; otherwise
    they and earlier calls are written into the messages (``frontend.tools.prompt_messages``).
    ``template_kwargs``: the request's ``chat_template_kwargs``."""
    unsupported = unsupported_message_fields(messages)
    if unsupported is not None:
        param, message = unsupported
        raise bad_request(message, param)
    shown = use if use is not None and use.choice != "none" else None
    try:
        rendered = prompt_messages([m.as_dict() for m in messages], shown, tokenizer.knows_tools)
        tools = shown.tools if shown is not None and tokenizer.knows_tools else None
        size = sum(len(m["content"] or "") for m in rendered) + len(str(tools or ""))
        return await tokenize_off_loop(size, tokenizer.encode_chat, rendered, max_chars, tools, template_kwargs)
    except (ValueError, ChatTemplateError) as e:  # PromptTooLong is a ValueError too
        raise bad_request(str(e), "messages") from None


async def chat_completions(request: Request) -> Response | StreamResponse:
    state: AppState = request.app.state.sluice
    body: ChatCompletionRequest = decode(await request.body(), ChatCompletionRequest)
    tokenizer: ModelTokenizer = state.require_tokenizer()
    check_model(state, body.model)
    check_priority(state, request, body.priority)
    use = tool_use(body.tools, body.tool_choice, body.parallel_tool_calls)
    max_chars = tokenizer.max_text_chars(state.require_model().max_model_len - 1)
    splits = state.splits_reasoning(tokenizer)
    kwargs = thinking_kwargs(body.chat_template_kwargs, body.reasoning_effort, splits, "reasoning_effort")
    prompt_ids = await chat_prompt_ids(tokenizer, body.messages, use, max_chars, kwargs)
    max_tokens, max_tokens_param = (body.max_completion_tokens, "max_completion_tokens") \
        if body.max_completion_tokens is not None else (body.max_tokens, "max_tokens")
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    grammar = await constraint_grammar(state, body, calls_constraint(use, tokenizer.tool_tags))
    sampling = sampling_params(state, body, len(prompt_ids), max_tokens, top_logprobs, default_max_tokens=None,
                         grammar=grammar, prompt_param="messages", max_tokens_param=max_tokens_param,
                         prompt_logprobs=body.prompt_logprobs)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    renderer = ChatRenderer(request_id, int(time.time()), state.model_name, tokenizer, prompt_ids,
                            body.return_token_ids, top_logprobs, tools=use, prompt_logprobs=body.prompt_logprobs)
    reasoning = starts_thinking(tokenizer, prompt_ids, grammar) if splits and body.separate_reasoning else None
    return await _run(state, request, body, prompt_ids, sampling, request_id, renderer, reasoning,
                      tools=use is not None and use.parses)


async def list_models(request: Request) -> Response:
    state: AppState = request.app.state.sluice
    model = state.client.model
    data = []
    if model is not None:
        data.append({"id": state.model_name, "object": "model", "created": state.started,
                     "owned_by": "sluice", "max_model_len": model.max_model_len, "dtype": model.dtype,
                     "quantization": model.quantization or None,
                     "kv_cache_dtype": model.kv_cache_dtype or model.dtype})
    return Response(_json.encode({"object": "list", "data": data}), media_type="application/json")
