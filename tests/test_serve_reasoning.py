"""Reasoning output through a real ``sluice serve``: a random checkpoint whose tokenizer has
``<think>`` and ``</think>`` as added tokens (so ``--reasoning-parser auto`` splits its answers)
and whose chat template thinks as the thinking models' do: it opens ``<think>`` in the generation
prompt (DeepSeek-R1, Qwen3-Thinking-2507), or leaves it to the model (``model_opens``, Qwen3's
hybrids), or renders a closed block (``enable_thinking: false``). A random model writes no
``<think>`` of its own, so a grammar (structured output) writes the think block for it; where
the prompt opened the block, the output is what greedy decoding writes, cut by ``max_tokens``.

The grammars name the tags as tokens (Lark's ``<think>``): llguidance counts every added token as
special, and a string literal that spells one lets the model pick that token and then refuses it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from checkpoints import save_llama_checkpoint, with_tags
from sluice_server import SluiceServer, running_server

pytestmark = pytest.mark.timeout(300)

TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif not model_opens %}<think>\n{% endif %}{% endif %}"
)
ASK = [{"role": "user", "content": "What is two and two?"}]
THOUGHT = {"grammar": 'start: <think> "\\nTwo and two.\\n" </think> "\\n\\nFour."'}  # what the model writes
MODEL_OPENS = {"model_opens": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    path = with_tags(save_llama_checkpoint(tmp_path_factory.mktemp("thinker")), ('<think>', '</think>'), TEMPLATE)
    with running_server("--model", str(path), "--num-kv-blocks", "64",
                        log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def chat(server: SluiceServer, **body: object) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 12, "temperature": 0} | body)
    assert r.status_code == 200, r.text
    return r.json()


def tag_ids(server: SluiceServer) -> dict[str, float]:
    """A logit bias that keeps the model from writing either tag by itself."""
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "<think></think>", "add_special_tokens": False})
    return {str(i): -100.0 for i in ids.json()["tokens"]}


def test_the_think_block_is_reasoning_content_streamed_or_not(server: SluiceServer) -> None:
    answer = chat(server, structured_outputs=THOUGHT, chat_template_kwargs=MODEL_OPENS, n=2,
                  max_tokens=40)
    for choice in answer["choices"]:
        assert choice["message"] == {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two."}
        assert choice["finish_reason"] == "stop"
    usage = answer["usage"]
    assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"]

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=ASK, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"structured_outputs": THOUGHT, "chat_template_kwargs": MODEL_OPENS})
    reasoning, content, kinds, counted = "", "", [], 0
    for chunk in stream:
        if not chunk.choices:  # the usage chunk
            assert chunk.usage is not None and chunk.usage.completion_tokens_details is not None
            counted = chunk.usage.completion_tokens_details.reasoning_tokens or 0
            continue
        delta = chunk.choices[0].delta
        thought = (delta.model_extra or {}).get("reasoning_content")
        reasoning += thought or ""
        content += delta.content or ""
        kinds += ["reasoning"] * bool(thought) + ["content"] * bool(delta.content)
    assert (reasoning, content) == ("Two and two.", "Four.")
    assert kinds == sorted(kinds, reverse=True)  # every reasoning delta before the content
    assert 2 * counted == usage["completion_tokens_details"]["reasoning_tokens"]  # n was 2 above


def test_a_prompt_that_opens_the_block_makes_a_cut_answer_all_reasoning(server: SluiceServer) -> None:
    bias = tag_ids(server)
    raw = chat(server, logit_bias=bias, separate_reasoning=False)["choices"][0]
    split = chat(server, logit_bias=bias)
    assert raw["message"].get("reasoning_content") is None and raw["finish_reason"] == "length"
    assert split["choices"][0]["message"]["content"] == ""
    assert split["choices"][0]["message"]["reasoning_content"] == (raw["message"]["content"].strip() or None)
    assert split["usage"]["completion_tokens_details"]["reasoning_tokens"] == split["usage"]["completion_tokens"]
    # A grammar's output is what the grammar allows from the first token: content.
    shaped = chat(server, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"enum": [4]}}, "required": ["n"]}}}, max_tokens=30)
    assert json.loads(shaped["choices"][0]["message"]["content"]) == {"n": 4}
    assert shaped["choices"][0]["message"]["reasoning_content"] is None


def test_thinking_off_renders_a_closed_block_and_the_answer_is_content(server: SluiceServer) -> None:
    bias = tag_ids(server)
    thinking = chat(server, logit_bias=bias)
    for off in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        answer = chat(server, logit_bias=bias, **off)
        raw = chat(server, logit_bias=bias, separate_reasoning=False, **off)
        # The template got the switch: its closed "<think>\n\n</think>\n\n" is in the prompt.
        assert answer["usage"]["prompt_tokens"] > thinking["usage"]["prompt_tokens"]
        assert answer["choices"][0]["message"]["reasoning_content"] is None
        assert answer["choices"][0]["message"]["content"] == raw["choices"][0]["message"]["content"] != ""
        assert answer["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_tool_calls_are_parsed_from_the_content(server: SluiceServer) -> None:
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    call = {"grammar": 'start: <think> "\\nAdd.\\n" </think> "\\n\\n<tool_call>\\n" CALL "\\n</tool_call>"\n'
                       'CALL: "{\\"name\\": \\"add\\", \\"arguments\\": {\\"a\\": 2}}"'}
    answer = chat(server, tools=[tool], structured_outputs=call, chat_template_kwargs=MODEL_OPENS,
                  max_tokens=120)
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "Add."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] \
        == [("add", {"a": 2})]


def test_the_responses_api_has_a_reasoning_item(server: SluiceServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    response = client.responses.create(model=model, input="What is two and two?", max_output_tokens=6,
                                       temperature=0, reasoning={"effort": "high"})
    assert response.status == "incomplete"
    (item,) = response.output
    assert item.type == "reasoning" and item.content and item.content[0].type == "reasoning_text"
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == 6
    events = list(client.responses.create(model=model, input="What is two and two?", max_output_tokens=6,
                                          temperature=0, stream=True))
    assert [e.type for e in events][-1] == "response.incomplete"
    final = events[-1].response  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert final.output[0].type == "reasoning" and final.output[0].content is not None
    assert deltas == final.output[0].content[0].text == item.content[0].text
