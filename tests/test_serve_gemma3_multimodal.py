"""An image-and-text Gemma 3 checkpoint (``Gemma3ForConditionalGeneration``, the form the 4B, 12B
and 27B models are released in) through a real ``sluice serve --model <dir>``: its text model
is served (greedy ids equal ``transformers``' for the same checkpoint), its image tower is not
loaded (said once at start-up), its chat template is read from ``chat_template.json``, and an
image in a chat message is refused with a 400 while the server keeps serving."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from checkpoints import hf_greedy, save_gemma3_multimodal
from sluice_server import SluiceServer, running_server

PROMPTS = [[1, *range(10, 14)], [1, *(t % 300 + 3 for t in range(40))]]  # the second: past the 6-token window
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_gemma3_multimodal(tmp_path_factory.mktemp("gemma3mm") / "ckpt")


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    with running_server("--model", str(checkpoint), "--max-num-batched-tokens", "16",
                        log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def test_the_text_model_generates_what_transformers_generates(server: SluiceServer, checkpoint: Path) -> None:
    want = hf_greedy(checkpoint, PROMPTS, NEW_TOKENS)
    for prompt, ids in zip(PROMPTS, want, strict=True):
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == ids
    assert re.search(r"text only: \d+ tensors of the checkpoint's other parts not loaded "
                     r"\(multi_modal_projector, vision_tower\)", server.log())


def test_chat_uses_the_processors_template_and_refuses_an_image(server: SluiceServer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{server.url}/tokenize", timeout=30, json={"messages": messages, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    rendered = httpx.post(f"{server.url}/tokenize", timeout=30,
                          json={"prompt": "<user>hi<assistant>", "add_special_tokens": False}).json()["tokens"]
    assert r.json()["tokens"] == rendered  # chat_template.json's template, not the frontend's default
    image = {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={"messages": [image], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={"messages": messages, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
