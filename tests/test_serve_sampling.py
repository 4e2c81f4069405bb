"""The sampling surface through a real ``sluice serve``: logit_bias, penalties and min_p change
what is generated the way they should, seeded requests repeat, bad values are OpenAI 400s."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sluice_server import SluiceServer, running_servers

from worker.model.tiny import materialize_tiny

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


@pytest.fixture(scope="module")
def greedy_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with temperature 0 in its generation_config.json."""
    model = tmp_path_factory.mktemp("model") / "greedy-tiny"
    shutil.copytree(materialize_tiny(), model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(config | {"temperature": 0.0}))
    return model


@pytest.fixture(scope="module")
def servers(greedy_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SluiceServer]]:
    """The tiny model; the greedy one; the greedy one with --generation-config none: side by side."""
    greedy = ("--model", str(greedy_model), "--num-kv-blocks", "64")
    with running_servers(("--model", "tiny"), greedy, (*greedy, "--generation-config", "none"),
                         log_dir=tmp_path_factory.mktemp("logs")) as started:
        yield started


@pytest.fixture(scope="module")
def server(servers: list[SluiceServer]) -> SluiceServer:
    return servers[0]


def _ids(url: str, **body: object) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True} | body)
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def test_logit_bias_forces_a_token(server: SluiceServer) -> None:
    assert _ids(server.url, logit_bias={"77": 100}) == [77] * 24
    plain = _ids(server.url)
    assert plain[0] not in _ids(server.url, max_tokens=1, logit_bias={str(plain[0]): -100})


def test_penalties_make_greedy_output_repeat_less(server: SluiceServer) -> None:
    plain = _ids(server.url, max_tokens=48)
    penalised = _ids(server.url, max_tokens=48, frequency_penalty=2.0, presence_penalty=2.0)
    repeated = _ids(server.url, max_tokens=48, repetition_penalty=1.8)
    assert len(set(plain)) < len(set(penalised)) and len(set(plain)) < len(set(repeated))
    assert _ids(server.url, max_tokens=48, frequency_penalty=2.0, presence_penalty=2.0) == penalised


def test_min_p_and_seed(server: SluiceServer) -> None:
    body = {"temperature": 1.0, "seed": 5, "min_p": 0.2}
    assert _ids(server.url, **body) == _ids(server.url, **body)
    # min_p 1.0 keeps only the most likely token: sampling becomes greedy.
    assert _ids(server.url, temperature=1.0, seed=9, min_p=1.0) == _ids(server.url)


def test_seeded_requests_ignore_what_else_is_in_the_batch(server: SluiceServer) -> None:
    """Each seeded request alone, then all of them together with unseeded noise in the same
    batches: the same tokens (penalised ones too, whose sampling reads their own history)."""
    seeded: list[dict[str, object]] = [
        {"temperature": 1.0, "seed": 11, "top_p": 0.9},
        {"temperature": 0.8, "seed": 12, "top_k": 20, "repetition_penalty": 1.3, "frequency_penalty": 0.5},
        {"temperature": 1.2, "seed": 13, "min_p": 0.05, "logit_bias": {"77": 5}}]
    alone = [_ids(server.url, **body) for body in seeded]

    async def together() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(body: dict[str, object], prompt: list[int]) -> list[int]:
                r = await client.post(f"{server.url}/v1/completions", json={
                    "prompt": prompt, "max_tokens": 24, "ignore_eos": True, "return_token_ids": True} | body)
                assert r.status_code == 200, r.text
                return list(r.json()["choices"][0]["token_ids"])

            noise = [one({"temperature": 1.0}, [1, *range(30 + i, 40 + 2 * i)]) for i in range(5)]
            results = await asyncio.gather(*(one(body, PROMPT) for body in seeded), *noise)
            return results[: len(seeded)]

    assert asyncio.run(together()) == alone


@pytest.mark.parametrize(("field", "value"), [
    ("logit_bias", {"abc": 1}), ("logit_bias", {"99999999": 1}), ("logit_bias", {"5": 101}),
    ("repetition_penalty", 0), ("min_p", 1.5), ("presence_penalty", 3), ("frequency_penalty", -2.5),
])
def test_bad_sampling_values_are_400s_naming_the_field(server: SluiceServer, field: str, value: object) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", field: value}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"].startswith(field)


def test_logit_bias_keys_that_are_not_plain_token_ids_are_400s(server: SluiceServer) -> None:
    """ "²" passes ``str.isdigit`` but not ``int``: it once gave a 500. Every key that is not
    ASCII digits naming an in-vocabulary id is a 400 naming ``logit_bias``; the server goes on."""
    for key in ["²", "\u0661", "-1", "", " 7", "+7", "1_0", "99999999999999999999999", "9" * 5000]:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "logit_bias": {key: 1}}, timeout=30)
        assert r.status_code == 400, (key[:30], r.status_code, r.text[:200])
        error = r.json()["error"]
        assert error["param"] == "logit_bias" and error["type"] == "invalid_request_error", (key[:30], error)
    assert _ids(server.url, max_tokens=2, logit_bias={"077": 100}) == [77, 77]


def test_the_models_sampling_defaults_apply_to_requests_that_leave_them_unset(
        servers: list[SluiceServer], greedy_model: Path) -> None:
    """A generation_config.json with temperature 0: a request that sets no temperature is greedy
    (the same text as an explicit temperature 0), one that sets 1.5 samples; with
    --generation-config none, OpenAI's default (temperature 1) applies again. Start-up says
    which defaults apply."""
    _, server, none = servers
    body = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}

    def text(**extra: object) -> str:
        r = httpx.post(f"{server.url}/v1/completions", json=body | extra, timeout=60)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])

    greedy = text(temperature=0)
    assert text() == text() == greedy
    assert len({text(temperature=1.5, seed=s) for s in range(4)} - {greedy}) >= 1
    assert f"sampling defaults from {greedy_model / 'generation_config.json'}: temperature 0" in server.log()
    samples = {httpx.post(f"{none.url}/v1/completions", json=body | {"seed": s}, timeout=60)
               .json()["choices"][0]["text"] for s in range(4)}
    assert samples != {greedy}, "OpenAI's default temperature 1 samples"
    assert "sampling defaults from" not in none.log()
