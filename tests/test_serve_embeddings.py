"""``/v1/embeddings`` through the real server: each input's final hidden states, pooled (last
token or mean) and L2-normalised, equal ``transformers``' on the same checkpoint, whether the
prompt is computed in one step or in chunks, alone or batched with other inputs and with chat
streams; the clients people use read them unchanged (the ``openai`` client, float and base64;
langchain-openai's ``OpenAIEmbeddings``; litellm's ``embedding()``); bad input is a 4xx, and
every KV block comes back."""

from __future__ import annotations

import base64
import concurrent.futures
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from checkpoints import save_llama_checkpoint
from openai import OpenAI
from sluice_server import SluiceServer, running_server, settled_stats

pytestmark = pytest.mark.timeout(600)

ADMIN = {"Authorization": "Bearer embeddings-test"}
# Short and long prompts (the long ones cross several 32-token prefill chunks) as token ids, and
# texts the byte-level tokenizer reads.
PROMPTS = [[1, 5, 9, 33], [1, *range(40, 140)], [1, 200, 201], [1, *range(10, 80)]]
TEXTS = ["hello world", "a somewhat longer sentence to embed, with punctuation!"]
# float32 on both sides, the same weights: the differences are summation order only.
MIN_COSINE, MAX_ABS = 0.99999, 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama_checkpoint(tmp_path_factory.mktemp("emb") / "ckpt")


def _hf_embeddings(path: Path, prompts: list[list[int]], pooling: str) -> list[np.ndarray]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]  # after the norm
            pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
            out.append(torch.nn.functional.normalize(pooled, dim=0).numpy())
    return out


@pytest.fixture(scope="module", params=["last", "mean"])
def served(request: pytest.FixtureRequest, checkpoint: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, SluiceServer]]:
    with running_server("--model", str(checkpoint), "--pooling", request.param, "--max-num-batched-tokens", "32",
                        "--num-kv-blocks", "64", "--admin-token", ADMIN["Authorization"].split()[1],
                        log_dir=tmp_path_factory.mktemp("logs")) as server:
        yield request.param, server


def _close(got: list[float], want: np.ndarray) -> None:
    vector = np.asarray(got, dtype=np.float32)
    assert vector.shape == want.shape
    assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5
    assert float(vector @ want) >= MIN_COSINE and float(np.abs(vector - want).max()) <= MAX_ABS


def test_equal_to_transformers_chunked_and_batched(served: tuple[str, SluiceServer], checkpoint: Path) -> None:
    pooling, server = served
    want = _hf_embeddings(checkpoint, PROMPTS, pooling)
    # All at once (one request, a batch of inputs), then each alone, then beside each other twice
    # (the second time the shared prefixes are in the prefix cache, for last pooling).
    batch = httpx.post(f"{server.url}/v1/embeddings", json={"input": PROMPTS}, timeout=60)
    assert batch.status_code == 200, batch.text
    body = batch.json()
    assert batch.headers["x-request-id"].startswith("embd-") and body["object"] == "list"
    assert [d["index"] for d in body["data"]] == list(range(len(PROMPTS)))
    assert body["usage"] == {"prompt_tokens": sum(map(len, PROMPTS)), "total_tokens": sum(map(len, PROMPTS))}
    for item, expected in zip(body["data"], want, strict=True):
        _close(item["embedding"], expected)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(2):
            alone = list(pool.map(lambda p: httpx.post(f"{server.url}/v1/embeddings", json={"input": p},
                                                       timeout=60).json(), PROMPTS))
            for reply, expected in zip(alone, want, strict=True):
                _close(reply["data"][0]["embedding"], expected)


def test_clients_read_them_unchanged(served: tuple[str, SluiceServer], checkpoint: Path) -> None:
    pooling, server = served
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    name = client.models.list().data[0].id
    ids = [httpx.post(f"{server.url}/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    want = _hf_embeddings(checkpoint, ids, pooling)
    # Left to itself, the openai client asks for base64 and decodes it; asked, it takes floats.
    for got in (client.embeddings.create(model=name, input=TEXTS),
                client.embeddings.create(model=name, input=TEXTS, encoding_format="float")):
        assert got.usage.prompt_tokens == sum(map(len, ids))
        for item, expected in zip(got.data, want, strict=True):
            _close(item.embedding, expected)
    raw = httpx.post(f"{server.url}/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    _close(np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4").tolist(), want[0])
    if pooling != "last":
        return  # the libraries below only carry the vectors: once is enough

    from langchain_openai import OpenAIEmbeddings

    lc = OpenAIEmbeddings(model=name, base_url=f"{server.url}/v1", api_key="unused",  # type: ignore[arg-type]
                          check_embedding_ctx_length=False, max_retries=0)
    for vector, expected in zip(lc.embed_documents(TEXTS), want, strict=True):
        _close(vector, expected)
    _close(lc.embed_query(TEXTS[0]), want[0])

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    reply = litellm.embedding(model=f"openai/{name}", input=TEXTS, api_base=f"{server.url}/v1", api_key="unused")
    for item, expected in zip(reply.data, want, strict=True):
        _close(item["embedding"], expected)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["fine", ""]}, "input[1]"),
    ({"input": [1, 2, 99999]}, "input"),
    ({"input": [[1, 2], "text", 7]}, "input[2]"),
    ({"input": [1] * 600}, "input"),
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "model": "text-embedding-3-small"}, "model"),
    ({"input": "x", "pooling": "cls"}, "pooling"),
])
def test_bad_input_is_a_clear_4xx_and_blocks_come_back(served: tuple[str, SluiceServer], body: dict,
                                                       param: str) -> None:
    _, server = served
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param
    assert httpx.post(f"{server.url}/v1/embeddings", json={"input": "still serving"}).status_code == 200


def test_beside_chat_streams_every_block_back(served: tuple[str, SluiceServer], checkpoint: Path) -> None:
    pooling, server = served
    want = _hf_embeddings(checkpoint, PROMPTS[1:2], pooling)[0]

    def chat() -> int:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                          json={"prompt": [1, 7, 8, 9], "max_tokens": 40, "stream": True, "ignore_eos": True}) as r:
            return sum(1 for line in r.iter_lines() if line.startswith("data: {"))

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(chat) for _ in range(3)]
        vectors = list(pool.map(lambda _: httpx.post(f"{server.url}/v1/embeddings", json={"input": PROMPTS[1]},
                                                     timeout=120).json(), range(6)))
        assert all(s.result() == 40 for s in streams)
    for reply in vectors:
        _close(reply["data"][0]["embedding"], want)
    stats = settled_stats(server, ADMIN)
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0, stats
    metrics = httpx.get(f"{server.url}/metrics").text
    assert any(line.startswith("sluice_endpoint_requests_total{") and 'endpoint="/v1/embeddings"' in line
               for line in metrics.splitlines())
