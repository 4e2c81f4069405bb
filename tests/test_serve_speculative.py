"""``--speculative ngram``, served: SmolLM2 answering prompts that quote their input gives, token
for token, the greedy answer of the same server without speculation, alone and in a batch; a
stream carries the same text; logprobs come with every token; structured output drafts and stays
valid; a request paused mid-stream and resumed ends with its undisturbed answer; the metrics count
proposals and acceptances per position; and every KV block comes back, aborted requests' too."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
from near_ties import greedy_ids
from sluice_server import SluiceServer, settled_stats, started_server

from worker.kernels import cpu as cpu_kernels

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: the kernels cannot be built here")]

ADMIN = {"Authorization": "Bearer spec-test"}
PARAGRAPH = ("The river runs past the old mill, under the stone bridge, and on to the sea. In spring the "
             "water is high and brown; in autumn it is low and clear, and the children of the village "
             "catch small fish under the bridge.")
QUESTIONS = [
    f"Repeat this text word for word:\n\n{PARAGRAPH}",
    f"Quote the first sentence of this text exactly:\n\n{PARAGRAPH}",
    f'Fill this JSON record from the text, {{"river_goes_to": "", "spring_water": ""}}:\n\n{PARAGRAPH}',
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SluiceServer, SluiceServer]]:
    """One server with speculation, one without, started side by side."""
    flags = ("--model", "smollm2", "--num-kv-blocks", "128", "--admin-token", "spec-test")
    with started_server(*flags, "--speculative", "ngram", "--num-speculative-tokens", "4",
                        log_dir=tmp_path_factory.mktemp("logs")) as drafting, \
            started_server(*flags, log_dir=tmp_path_factory.mktemp("logs")) as plain:
        drafting.wait_ready()
        plain.wait_ready()
        yield drafting, plain


@pytest.fixture(scope="module")
def server(servers: tuple[SluiceServer, SluiceServer]) -> SluiceServer:
    return servers[0]


def spec_metrics(server: SluiceServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line.startswith("sluice_spec_decode")}


def test_greedy_answers_are_the_answers_without_speculation(servers: tuple[SluiceServer, SluiceServer]) -> None:
    server, plain = servers
    prompts = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in QUESTIONS]  # SmolLM2's template

    async def run(url: str) -> tuple[list[list[int]], list[list[int]]]:
        async with httpx.AsyncClient(timeout=300) as client:
            alone = [await greedy_ids(client, url, p, NEW_TOKENS) for p in prompts]
            together = list(await asyncio.gather(*(greedy_ids(client, url, p, NEW_TOKENS) for p in prompts)))
            return alone, together

    expected, _ = asyncio.run(run(plain.url))
    alone, together = asyncio.run(run(server.url))
    assert alone == expected
    assert together == expected
    counts = spec_metrics(server)
    drafted = counts['sluice_spec_decode_num_draft_tokens_total{model_name="smollm2"}']
    accepted = counts['sluice_spec_decode_num_accepted_tokens_total{model_name="smollm2"}']
    assert 0 < accepted <= drafted  # the quotes were proposed, and some accepted
    first = counts['sluice_spec_decode_num_accepted_tokens_per_pos_total{model_name="smollm2",position="0"}']
    assert 0 < first <= counts['sluice_spec_decode_num_draft_tokens_per_pos_total{model_name="smollm2",position="0"}']
    stats = settled_stats(server, ADMIN)
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0  # every block came back
    assert stats["spec_accepted_tokens"] >= accepted  # (the metrics show the scheduler's figures of its last ping)


def test_a_stream_carries_the_same_text(server: SluiceServer) -> None:
    body = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "temperature": 0, "max_tokens": NEW_TOKENS}
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300).json()
    parts = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body | {"stream": True}, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                parts += [c["delta"].get("content") or "" for c in chunk["choices"]]
    assert "".join(parts) == whole["choices"][0]["message"]["content"]


def test_logprobs_come_with_every_token(servers: tuple[SluiceServer, SluiceServer]) -> None:
    """A request with logprobs drafts too: each token, accepted draft or not, has its own entry,
    those of the same answer without speculation."""
    body = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "temperature": 0, "max_tokens": NEW_TOKENS,
            "logprobs": True, "top_logprobs": 2}
    before = settled_stats(servers[0], ADMIN)["spec_accepted_tokens"]
    answers = [httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
               for s in servers]
    assert settled_stats(servers[0], ADMIN)["spec_accepted_tokens"] > before  # it did draft
    drafted, plain = ([(e["token"], e["logprob"], [t["token"] for t in e["top_logprobs"]])
                       for e in a["logprobs"]["content"]] for a in answers)
    assert answers[0]["message"]["content"] == answers[1]["message"]["content"]
    assert len(drafted) == len(plain) == len(answers[0]["logprobs"]["content"]) > 0
    for (token, lp, top), (token0, lp0, top0) in zip(drafted, plain, strict=True):
        assert (token, top) == (token0, top0) and lp == pytest.approx(lp0, abs=1e-4)


def test_structured_output_drafts_and_stays_valid(servers: tuple[SluiceServer, SluiceServer]) -> None:
    """A request held to a JSON schema drafts what its grammar allows (the values quote the
    text): the same answer as without speculation, valid against its schema."""
    schema = {"type": "object", "additionalProperties": False, "required": ["first_sentence", "season"],
              "properties": {"first_sentence": {"type": "string", "maxLength": 200},
                             "season": {"enum": ["spring", "autumn"]}}}
    body = {"messages": [{"role": "user", "content": "Copy the first sentence of this text into first_sentence, and "
                                                     f"name a season it mentions:\n\n{PARAGRAPH}"}],
            "temperature": 0, "max_tokens": 96,
            "response_format": {"type": "json_schema", "json_schema": {"name": "river", "schema": schema}}}
    before = settled_stats(servers[0], ADMIN)["spec_accepted_tokens"]
    answers = [httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
               for s in servers]
    assert settled_stats(servers[0], ADMIN)["spec_accepted_tokens"] > before  # it drafted, and kept some
    assert answers[0]["message"]["content"] == answers[1]["message"]["content"]
    value = json.loads(answers[0]["message"]["content"])
    assert set(value) == {"first_sentence", "season"} and value["season"] in ("spring", "autumn")
    assert value["first_sentence"].startswith("The river")  # quoted from the text
    assert settled_stats(servers[0], ADMIN)["kv_blocks_used"] == 0


def test_pause_resume_and_abort_mid_stream(servers: tuple[SluiceServer, SluiceServer]) -> None:
    """A drafting request paused mid-stream decodes nothing while paused and, resumed, ends with
    the answer it gives undisturbed; one aborted mid-stream gives back its blocks."""
    server, plain = servers
    prompt = f"<|im_start|>user\n{QUESTIONS[0]}<|im_end|>\n<|im_start|>assistant\n"
    want = asyncio.run(_greedy(plain.url, prompt))
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "min_tokens": NEW_TOKENS, "temperature": 0,
            "return_token_ids": True, "stream": True}

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=300) as client:
            tokens: list[int] = []
            async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                request_id = r.headers["X-Request-Id"]
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        tokens += json.loads(line[6:])["choices"][0]["token_ids"]
                    if len(tokens) >= 8:
                        break
                await client.post(f"{server.url}/admin/requests/{request_id}/pause", headers=ADMIN)
                frozen = await _settled_output(client, server.url, request_id)
                await asyncio.sleep(0.5)
                assert (await _settled_output(client, server.url, request_id)) == frozen  # nothing decoded
                await client.post(f"{server.url}/admin/requests/{request_id}/resume", headers=ADMIN)
                async for line in lines:
                    if line.startswith("data: {"):
                        tokens += json.loads(line[6:])["choices"][0]["token_ids"]
            # Another, aborted once it has streamed a few tokens.
            async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                request_id, seen = r.headers["X-Request-Id"], 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: {")
                    if seen == 3:
                        await client.post(f"{server.url}/admin/requests/{request_id}/abort", headers=ADMIN)
            return tokens

    assert asyncio.run(run()) == want
    stats = settled_stats(server, ADMIN)
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0


async def _greedy(url: str, prompt: str) -> list[int]:
    async with httpx.AsyncClient(timeout=300) as client:
        return await greedy_ids(client, url, prompt, NEW_TOKENS)


async def _settled_output(client: httpx.AsyncClient, url: str, request_id: str) -> int:
    """The paused request's output tokens once it is out of the worker's plans."""
    for _ in range(600):
        info = (await client.get(f"{url}/admin/requests/{request_id}", headers=ADMIN)).json()
        if info["state"] == "paused" and not info["in_flight"]:
            return int(info["output_tokens"])
        await asyncio.sleep(0.05)
    raise AssertionError(f"{request_id} never settled paused")


def test_a_draft_model_gives_the_same_answers(servers: tuple[SluiceServer, SluiceServer],
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """``--speculative-model``: SmolLM2 drafting for itself, so nearly every guess is kept (a
    guess can differ only where the draft, one row alone, and the target's verifying batch round
    a near tie apart)."""
    plain = servers[1]
    prompts = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in QUESTIONS]

    async def run(url: str) -> list[list[int]]:
        async with httpx.AsyncClient(timeout=300) as client:
            return list(await asyncio.gather(*(greedy_ids(client, url, p, NEW_TOKENS) for p in prompts)))

    with started_server("--model", "smollm2", "--num-kv-blocks", "128", "--admin-token", "spec-test",
                        "--speculative-model", "smollm2", "--num-speculative-tokens", "4",
                        log_dir=tmp_path_factory.mktemp("logs")) as drafting:
        drafting.wait_ready()
        assert asyncio.run(run(drafting.url)) == asyncio.run(run(plain.url))
        stats = settled_stats(drafting, ADMIN)
        assert stats["kv_blocks_used"] == 0 and stats["running"] == 0
        assert stats["spec_accepted_tokens"] >= 0.9 * stats["spec_draft_tokens"] > 0


def test_n_choices_are_the_choices_without_speculation(servers: tuple[SluiceServer, SluiceServer]) -> None:
    """``n`` > 1 (the prompt's blocks shared by the choices, copied on write): each seeded choice
    drafts on its own and ends as it does without speculation."""
    body = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": NEW_TOKENS, "n": 3,
            "temperature": 0.7, "seed": 11}
    before = settled_stats(servers[0], ADMIN)["spec_accepted_tokens"]
    drafted, plain = ([c["message"]["content"] for c in sorted(
        httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=300).json()["choices"],
        key=lambda c: c["index"])] for s in servers)
    assert drafted == plain and len(set(plain)) > 1  # the same three answers, not all alike
    stats = settled_stats(servers[0], ADMIN)
    assert stats["spec_accepted_tokens"] > before and stats["kv_blocks_used"] == 0
