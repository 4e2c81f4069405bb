"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API.

A request is read into what chat completions serve (``frontend.responses_input``): its
conversation (a stored one it continues, then its ``input``) as chat messages under its
``instructions``, its tools, its ``text.format`` as a structured-output constraint. From there it
is a chat completion: the same template, validation, sampling and engine request; only its
output is rendered as the Responses API's items and events (``frontend.responses_render``). A
finished response is stored (``store``, true by default, as OpenAI's) with the conversation that
led to it, so ``previous_response_id`` continues it (``frontend.responses_store``).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.errors import APIError, bad_request
from frontend.openai_api import (
    chat_prompt_ids,
    check_capacity,
    check_model,
    check_priority,
    constraint_grammar,
    engine_output,
    json_response,
    sampling_params,
    starts_thinking,
    thinking_kwargs,
)
from frontend.responses_input import (
    ResponsesRequest,
    chat_tool_choice,
    chat_tools,
    check_unsupported,
    input_messages,
    output_messages,
    reasoning_effort,
    response_format,
)
from frontend.responses_render import ResponsesRenderer, new_id
from frontend.responses_store import ResponseStore, StoredResponse
from frontend.schemas import ChatMessage, SamplingFields, StreamOptions, decode
from frontend.sse import StreamResponse, collect
from frontend.state import AppState
from frontend.tools import calls_constraint, tool_use

# Errors of the chat path name chat's fields; a Responses client knows them by these names.
_PARAMS = {"messages": "input", "response_format": "text.format", "max_tokens": "max_output_tokens"}


def _renamed(error: APIError) -> APIError:
    if error.param in _PARAMS:
        error.param = _PARAMS[error.param]
    return error


async def _history(state: AppState, previous_id: str | None) -> list[dict[str, Any]]:
    """The conversation ``previous_response_id`` continues: its input, then its output."""
    if previous_id is None:
        return []
    store = state.responses
    if store is None:
        raise bad_request("previous_response_id needs stored responses; this server runs with --responses-store none",
                          "previous_response_id")
    previous = await store.get(previous_id)
    if previous is None:
        raise APIError(404, f"Previous response with id '{previous_id[:100]}' not found.",
                       param="previous_response_id", code="previous_response_not_found")
    if previous.model != state.model_name:
        raise bad_request(f"previous_response_id {previous_id!r} was answered by the model {previous.model!r}; this "
                          f"server serves {state.model_name!r}", "previous_response_id")
    return previous.messages + output_messages(previous.response["output"])


def _echo(body: ResponsesRequest, parallel: bool, stored: bool) -> dict[str, Any]:
    """What the response object repeats of its request."""
    return {
        "instructions": body.instructions, "metadata": body.metadata or {}, "parallel_tool_calls": parallel,
        "temperature": body.temperature, "top_p": body.top_p,
        "tool_choice": body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none"),
        "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}},
        "max_output_tokens": body.max_output_tokens, "previous_response_id": body.previous_response_id,
        "store": stored, "user": body.user, "truncation": body.truncation or "disabled", "background": False,
        "reasoning": {"effort": body.reasoning.get("effort"), "summary": body.reasoning.get("summary")}
        if body.reasoning else None,
        "service_tier": body.service_tier or "default",
    }


async def create_response(request: Request) -> Response | StreamResponse:
    state: AppState = request.app.state.sluice
    body: ResponsesRequest = decode(await request.body(), ResponsesRequest)
    check_unsupported(body)
    effort = reasoning_effort(body.reasoning)
    tokenizer = state.require_tokenizer()
    check_model(state, body.model)
    check_priority(state, request, body.priority)
    tools, choice = chat_tool_choice(body.tool_choice, chat_tools(body.tools))
    use = tool_use(tools, choice, body.parallel_tool_calls)
    conversation = input_messages(body.input, await _history(state, body.previous_response_id))
    shown = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    try:
        messages = [msgspec.convert(m, ChatMessage) for m in shown]
    except msgspec.ValidationError as e:
        raise bad_request(f"input cannot be read as a conversation: {e}", "input") from None
    fields = SamplingFields(model=body.model, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                            seed=body.seed, priority=body.priority, user=body.user or body.safety_identifier,
                            stream=body.stream, stream_options=StreamOptions(include_usage=True),
                            response_format=response_format(body.text))
    splits = state.splits_reasoning(tokenizer)
    try:
        max_chars = tokenizer.max_text_chars(state.require_model().max_model_len - 1)
        kwargs = thinking_kwargs(None, effort, splits, "reasoning.effort")
        prompt_ids = await chat_prompt_ids(tokenizer, messages, use, max_chars, kwargs)
        grammar = await constraint_grammar(state, fields, calls_constraint(use, tokenizer.tool_tags))
        sampling = sampling_params(state, fields, len(prompt_ids), body.max_output_tokens, None, default_max_tokens=None,
                             grammar=grammar, prompt_param="input", max_tokens_param="max_output_tokens")
    except APIError as e:
        raise _renamed(e) from None
    response_id = new_id("resp")
    store = state.responses if body.store else None

    def finished(response: dict[str, Any]) -> None:
        if store is not None:
            store.put(StoredResponse(response_id, state.model_name, response["created_at"], response, conversation))

    renderer = ResponsesRenderer(response_id, int(time.time()), state.model_name,
                                 _echo(body, use.parallel if use else body.parallel_tool_calls is not False,
                                       store is not None), use, finished)
    check_capacity(state)
    reasoning = starts_thinking(tokenizer, prompt_ids, grammar) if splits else None
    output = engine_output(state, fields, prompt_ids, sampling, response_id, renderer, reasoning=reasoning,
                           tools=use is not None and use.parses)
    handle = await state.client.add(output)
    if body.stream:
        return StreamResponse(handle, {"X-Request-Id": response_id})
    await collect(handle, request.receive)
    return json_response(output.body(), response_id)


def _store(state: AppState) -> ResponseStore:
    if state.responses is None:
        raise APIError(404, "this server keeps no responses (--responses-store none)", code="not_found")
    return state.responses


async def get_response(request: Request) -> Response:
    state: AppState = request.app.state.sluice
    rid = request.path_params["response_id"]
    stored = await _store(state).get(rid)
    if stored is None:
        raise APIError(404, f"Response with id '{rid[:100]}' not found.", code="not_found")
    return json_response(stored.response, rid)


async def delete_response(request: Request) -> Response:
    state: AppState = request.app.state.sluice
    rid = request.path_params["response_id"]
    if not await _store(state).delete(rid):
        raise APIError(404, f"Response with id '{rid[:100]}' not found.", code="not_found")
    return json_response({"id": rid, "object": "response", "deleted": True}, rid)
