"""``/tokenize`` and ``/detokenize``, with vLLM's shapes: what the server would compute for a
prompt or a conversation, and text back from token ids — for clients that count tokens against
``max_model_len``, truncate prompts or debug a chat template without generating anything.

``{"prompt": str}`` is tokenized as ``/v1/completions`` tokenizes it (with the BOS token the model
expects, unless ``add_special_tokens`` is false); ``{"messages": [...]}`` is rendered with the chat
template and tokenized as ``/v1/chat/completions`` does (with its ``tools`` and ``tool_choice``,
which change the prompt). The answer is
``{"tokens", "count", "max_model_len"}``; a prompt longer than the model's context is counted all
the same (that is often what the client wants to know). ``/detokenize`` decodes the ids as they
are, special tokens included, so it inverts ``/tokenize``. ``GET /tokenizer_info`` gives the
special tokens and the chat template (vLLM's endpoint of that name): with the two above, a client
such as lm-evaluation-harness tokenizes through the server instead of fetching the tokenizer.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.errors import bad_request
from frontend.openai_api import chat_prompt_ids, check_model, check_token_ids, tokenize_off_loop
from frontend.schemas import DetokenizeRequest, TokenizeRequest, decode
from frontend.state import AppState
from frontend.tools import tool_use

_json = msgspec.json.Encoder()


async def tokenize(request: Request) -> Response:
    state: AppState = request.app.state.sluice
    body = decode(await request.body(), TokenizeRequest)
    check_model(state, body.model)
    tokenizer = state.require_tokenizer()
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
        if body.add_special_tokens:
            tokens = await tokenize_off_loop(len(body.prompt), tokenizer.encode_prompt, body.prompt)
        else:
            tokens = await tokenize_off_loop(len(body.prompt), tokenizer.encode_text, body.prompt)
    else:
        assert body.messages is not None
        use = tool_use(body.tools, body.tool_choice, None)
        tokens = await chat_prompt_ids(tokenizer, body.messages, use, template_kwargs=body.chat_template_kwargs)
    body_out = {"tokens": tokens, "count": len(tokens), "max_model_len": state.require_model().max_model_len}
    return Response(_json.encode(body_out), media_type="application/json")


async def detokenize(request: Request) -> Response:
    state: AppState = request.app.state.sluice
    body = decode(await request.body(), DetokenizeRequest)
    check_model(state, body.model)
    tokenizer = state.require_tokenizer()
    check_token_ids(body.tokens, tokenizer.vocab_size, "tokens")
    text = tokenizer.decode(body.tokens, skip_special_tokens=False)
    return Response(_json.encode({"prompt": text}), media_type="application/json")


async def tokenizer_info(request: Request) -> Response:
    state: AppState = request.app.state.sluice
    tokenizer = state.require_tokenizer()
    model = state.require_model()

    def text(token_id: int | None) -> str | None:
        return tokenizer.token_str(token_id) if token_id is not None else None

    body = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text(model.bos_token_id),
        "eos_token": text(model.eos_token_ids[0] if model.eos_token_ids else None),
        "pad_token": None,
        "add_bos_token": model.add_bos_token,
        "chat_template": model.chat_template,
        "model_max_length": model.max_model_len,
        "vocab_size": model.vocab_size,
    }
    return Response(_json.encode(body), media_type="application/json")
