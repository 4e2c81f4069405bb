"""A scheduler's frontend-facing sockets, driven by a test: real ZeroMQ ROUTER sockets that an
``EngineClient`` connects to. It answers pings (announcing a model built on the tests' small
tokenizer), records every other message the frontend sends, and sends whatever the test gives
it (token batches are numbered as the real scheduler numbers them unless the test says not to).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import zmq
import zmq.asyncio

from protocol.messages import (
    AddRequest,
    EngineReady,
    Finish,
    FinishReason,
    FrontendMessage,
    ModelInfo,
    Ping,
    Pong,
    TokenBatch,
    new_epoch,
)
from protocol.transport import Endpoints, make_socket, scheduler_frontend_codec
from worker.model.tiny import build_byte_level_tokenizer


def model_info(num_kv_blocks: int = 64) -> ModelInfo:
    tok = build_byte_level_tokenizer(512)
    return ModelInfo(name="fake", max_model_len=512, vocab_size=512, eos_token_ids=[2], bos_token_id=1,
                     tokenizer_json=tok.to_str(), chat_template=None, add_bos_token=True,
                     num_kv_blocks=num_kv_blocks, block_size=16)


class FakeScheduler:
    def __init__(self, address: str, info: ModelInfo | None = None) -> None:
        self.endpoints = Endpoints.from_base(address)
        self.info = info or model_info()
        self.ctx = zmq.asyncio.Context()
        self.inbox: Any = make_socket(self.ctx, zmq.ROUTER, self.endpoints.frontend_to_scheduler, bind=True)
        self.outbox: Any = make_socket(self.ctx, zmq.ROUTER, self.endpoints.scheduler_to_frontend, bind=True)
        self.codec = scheduler_frontend_codec()
        self.received: list[FrontendMessage] = []
        self.frontend: bytes | None = None
        self.answer_pings = True
        self.refuse_adds: str | None = None  # an error every AddRequest is answered with
        self.epoch = new_epoch()
        self.seq = 0
        self._arrived = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> FakeScheduler:
        self._task = asyncio.create_task(self._serve())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.inbox.close(linger=0)
        self.outbox.close(linger=0)
        self.ctx.term()

    async def _serve(self) -> None:
        while True:
            frontend, data = await self.inbox.recv_multipart()
            self.frontend = frontend
            msg = self.codec.decode(data)
            if isinstance(msg, Ping):
                if self.answer_pings:
                    await self._send(Pong(msg.sent_at, True, True, {}, self.epoch, "", self.seq))
                    if msg.need_model:
                        await self._send(EngineReady(self.info))
                continue
            self.received.append(msg)
            self._arrived.set()
            if self.refuse_adds is not None and isinstance(msg, AddRequest):
                await self.send(TokenBatch([], [], [Finish(msg.rid + i, FinishReason.ERROR, 0, 0, 0, self.refuse_adds)
                                                    for i in range(msg.n)]))

    async def _send(self, msg: object) -> None:
        assert self.frontend is not None
        with contextlib.suppress(zmq.ZMQError):  # the frontend's receiving socket may not be connected yet
            await self.outbox.send_multipart([self.frontend, self.codec.encode(msg)])

    async def send(self, batch: TokenBatch, number: bool = True) -> None:
        """``batch`` to the frontend, numbered next unless ``number`` is False (then as it is)."""
        if number:
            self.seq += 1
            batch.seq = self.seq
        await self._send(batch)

    async def wait_for(self, kind: type, count: int = 1, timeout: float = 10.0) -> list[Any]:
        """The first ``count`` messages of type ``kind`` the frontend sent (waiting for them)."""
        async with asyncio.timeout(timeout):
            while True:
                found = [m for m in self.received if isinstance(m, kind)]
                if len(found) >= count:
                    return found[:count]
                self._arrived.clear()
                await self._arrived.wait()
