"""``Generation`` alone (one class, over a real ``RequestStream``): a backlog of tokens — a client
that fell behind — goes out as one delta, while a consumer that keeps up gets one per token."""

from __future__ import annotations

import asyncio

from test_frontend_text import tokenizer  # noqa: F401 - the module-scoped fixture

from frontend.engine_client import RequestStream
from frontend.generation import COALESCE_AFTER, Delta, Generation
from frontend.tokenizer import ModelTokenizer
from protocol.messages import AddRequest, Finish, FinishReason, SamplingParams


class OneStreamClient:
    """The part of ``EngineClient`` a ``Generation`` uses, for one request."""

    def __init__(self) -> None:
        self.stream: RequestStream | None = None
        self.aborted: list[int] = []

    async def add(self, request: AddRequest) -> RequestStream:
        self.stream = RequestStream(request.rid)
        return self.stream

    async def abort(self, rid: int) -> None:
        self.aborted.append(rid)

    def abort_soon(self, rid: int) -> None:
        self.aborted.append(rid)

    def release(self, rid: int) -> None:
        pass


def run(tok: ModelTokenizer, ids: list[int], at_once: bool, logprobs: int | None = None) -> list[Delta]:
    async def main() -> list[Delta]:
        client = OneStreamClient()
        params = SamplingParams(max_tokens=len(ids), ignore_eos=True, logprobs=logprobs)
        gen = Generation(client, tok, AddRequest(1, "r1", [5, 6], params), [])  # type: ignore[arg-type]
        await gen.start()
        assert client.stream is not None
        stream = client.stream
        deltas: list[Delta] = []

        async def consume() -> None:
            async for delta in gen.deltas():
                deltas.append(delta)

        task = asyncio.create_task(consume())
        lp = (0.0, [], []) if logprobs is not None else None
        for i, token in enumerate(ids):
            stream.push(token, lp)
            if i == len(ids) - 1:
                stream.close(Finish(1, FinishReason.LENGTH, 2, 0, len(ids)))
            if not at_once:
                await asyncio.sleep(0)  # the consumer runs between tokens
        await task
        return deltas

    return asyncio.run(main())


def test_a_backlog_goes_out_as_one_delta_and_a_steady_stream_token_by_token(
        tokenizer: ModelTokenizer) -> None:  # noqa: F811
    ids = tokenizer.encode_prompt("The quick brown fox jumps over the lazy dog. " * 40)[1:]
    assert len(ids) > COALESCE_AFTER
    backlog = run(tokenizer, ids, at_once=True)
    steady = run(tokenizer, ids, at_once=False)
    with_logprobs = run(tokenizer, ids, at_once=True, logprobs=2)
    assert len(backlog) == 1 and backlog[0].token_ids == ids and backlog[0].finish_reason == "length"
    assert len(steady) == len(ids) and all(len(d.token_ids) == 1 for d in steady)
    assert len(with_logprobs) == len(ids)  # per-token logprobs stay per token
    for deltas in (backlog, steady, with_logprobs):
        assert "".join(d.text for d in deltas) == tokenizer.decode(ids)
