"""The frontend's side of the ZeroMQ link to the scheduler.

One task owns the receiving socket: it decodes each ``SchedulerMessage`` and dispatches it by type.
Tokens land in the ``RequestStream`` of their request; the HTTP handler awaiting that stream
wakes once per batch of tokens, so a lagging client drains several tokens in one write.

Each frontend incarnation has a random epoch: the high bits of every rid it issues and its
routing id at the scheduler, which sends a request's tokens to its owner only. Pongs carry the
scheduler's epoch: when it changes, the scheduler restarted and the live streams end with an
error at once (the new scheduler never heard of them) instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocol.curve import CurveKeys
from protocol.messages import (
    RID_COUNTER_BITS,
    AbortRequest,
    AddRequest,
    EngineError,
    EngineReady,
    Finish,
    FinishReason,
    FrontendMessage,
    Logprob,
    ModelInfo,
    PauseRequest,
    Ping,
    Pong,
    Query,
    QueryReply,
    ResumeRequest,
    SetPriority,
    TokenBatch,
    new_epoch,
)
from protocol.transport import Endpoints, frontend_codec, frontend_identity, make_socket

log = logging.getLogger("sluice.frontend")

PING_INTERVAL_S = 0.5
# The scheduler answers pings within milliseconds when alive; this much silence means it is not.
SCHEDULER_TIMEOUT_S = 5.0
WAITING_LOG_INTERVAL_S = 5.0


class RequestStream:
    """Tokens of one request as they arrive, and its single finish."""

    __slots__ = ("_event", "arrivals", "finish", "first_token_at", "logprobs", "rid", "token_ids")

    def __init__(self, rid: int) -> None:
        self.rid = rid
        self.token_ids: list[int] = []
        self.logprobs: list[Logprob] = []
        self.finish: Finish | None = None
        self.first_token_at: float | None = None
        self.arrivals: list[float] = []  # monotonic time each token reached the frontend
        self._event = asyncio.Event()

    def push(self, token_id: int, logprob: Logprob) -> None:
        if self.finish is not None:
            return  # tokens racing an abort are dropped: nothing past a finish
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        self.arrivals.append(now)
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self._event.set()

    def close(self, finish: Finish) -> None:
        if self.finish is None:
            self.finish = finish
            self._event.set()

    async def wait(self) -> None:
        """Wait until something new arrived since the last call."""
        await self._event.wait()
        self._event.clear()


class EngineClient:
    def __init__(self, address: str, curve: CurveKeys | None = None) -> None:
        self._endpoints = Endpoints.from_base(address)
        self._curve = curve
        self._ctx = zmq.asyncio.Context()
        self._codec = frontend_codec()
        self._streams: dict[int, RequestStream] = {}
        self.rid_by_id: dict[str, int] = {}  # live requests' public ids, for the admin API
        self._id_by_rid: dict[int, str] = {}
        self._queries: dict[int, asyncio.Future[QueryReply]] = {}
        self.epoch = new_epoch()
        self._rids = itertools.count((self.epoch << RID_COUNTER_BITS) + 1)
        self._scheduler_epoch = 0
        self._query_ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self.model: ModelInfo | None = None
        self.ready = asyncio.Event()
        self.quiet_startup_errors = False
        self.workers_alive = False
        self.scheduler_ready = False  # the scheduler's word in its last pong
        self.stats: dict[str, Any] | None = None  # the scheduler's latest snapshot (from Pong)
        self.engine_error: str | None = None
        self.unhealthy_reason = ""  # the scheduler's word on why workers are not serving
        self.malformed_frames = 0
        self._last_pong = 0.0
        self._said_waiting = False  # "waiting for the scheduler" was logged, its end not yet
        self._handlers: dict[type, Callable[[Any], None]] = {
            TokenBatch: self._on_tokens,
            EngineReady: self._on_ready,
            Pong: self._on_pong,
            QueryReply: self._on_query_reply,
            EngineError: self._on_engine_error,
        }

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        # zmq.asyncio sockets return awaitables, which pyzmq's stubs do not express.
        identity = frontend_identity(self.epoch)
        self._push: Any = make_socket(self._ctx, zmq.DEALER, self._endpoints.frontend_to_scheduler, bind=False,
                                      identity=identity, curve=self._curve)
        self._pull: Any = make_socket(self._ctx, zmq.DEALER, self._endpoints.scheduler_to_frontend, bind=False,
                                      identity=identity, curve=self._curve)
        self._links: Any = self._push.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="engine-receive"),
            asyncio.create_task(self._ping_loop(), name="engine-ping"),
            asyncio.create_task(self._link_loop(), name="engine-links"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._push.disable_monitor()
        self._links.close(linger=0)
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()

    @property
    def healthy(self) -> bool:
        return self.scheduler_alive and self.scheduler_ready and self.workers_alive and self.engine_error is None

    @property
    def scheduler_alive(self) -> bool:
        return time.monotonic() - self._last_pong < SCHEDULER_TIMEOUT_S

    @property
    def num_live(self) -> int:
        return len(self._streams)

    @property
    def num_waiting_first_token(self) -> int:
        return sum(1 for s in self._streams.values() if s.first_token_at is None)

    # ----------------------------------------------------------------- requests

    def next_rid(self) -> int:
        return next(self._rids)

    async def add(self, request: AddRequest) -> RequestStream:
        stream = RequestStream(request.rid)
        self._streams[request.rid] = stream
        self.rid_by_id[request.request_id] = request.rid
        self._id_by_rid[request.rid] = request.request_id
        await self._send(request)
        return stream

    async def abort(self, rid: int) -> None:
        """Ask the scheduler to end ``rid``; its Finish(abort) arrives like any other finish."""
        if rid in self._streams:
            await self._send(AbortRequest(rid))

    def abort_soon(self, rid: int) -> None:
        """``abort`` from a place that cannot await (a handler being cancelled by a disconnect)."""
        if rid in self._streams:
            task = asyncio.get_running_loop().create_task(self._send(AbortRequest(rid)))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def abort_all(self) -> None:
        """Abort every live request (shutting down): each ends with a ``Finish(abort)``."""
        for rid in list(self._streams):
            await self._send(AbortRequest(rid))

    def release(self, rid: int) -> None:
        """Forget a stream whose handler is done with it (finished, or the client went away)."""
        self._streams.pop(rid, None)
        request_id = self._id_by_rid.pop(rid, None)
        if request_id is not None:
            self.rid_by_id.pop(request_id, None)

    async def query(self, what: str, rid: int = -1, timeout: float = 5.0) -> QueryReply:
        qid = next(self._query_ids)
        fut: asyncio.Future[QueryReply] = asyncio.get_running_loop().create_future()
        self._queries[qid] = fut
        try:
            await self._send(Query(qid, what, rid))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._queries.pop(qid, None)

    async def send_control(self, msg: FrontendMessage) -> None:
        await self._send(msg)

    async def control(self, msg: SetPriority | PauseRequest | ResumeRequest, timeout: float = 5.0) -> bool:
        """Send a control and wait until the scheduler has applied it: True if the request was
        live there. Raises ``TimeoutError`` if the scheduler does not answer."""
        qid = next(self._query_ids)
        msg.query_id = qid
        fut: asyncio.Future[QueryReply] = asyncio.get_running_loop().create_future()
        self._queries[qid] = fut
        try:
            await self._send(msg)
            return (await asyncio.wait_for(fut, timeout)).found
        finally:
            self._queries.pop(qid, None)

    async def _send(self, msg: FrontendMessage) -> None:
        await self._push.send(self._codec.encode(msg), copy=False)

    # ----------------------------------------------------------------- receiving

    async def _receive_loop(self) -> None:
        while True:
            frame = await self._pull.recv(copy=False)
            try:
                msg = self._codec.decode(frame.buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.malformed_frames += 1
                if self.malformed_frames == 1 or self.malformed_frames % 1000 == 0:
                    log.warning("dropped a frame that is not a Sluice message (%s); %d so far", e,
                                self.malformed_frames)
                continue
            try:
                self._handlers[type(msg)](msg)
            except Exception:
                log.exception("failed to handle %s from the scheduler", type(msg).__name__)

    async def _ping_loop(self) -> None:
        was_alive = False
        started = time.monotonic()
        while True:
            await self._send(Ping(time.time(), need_model=self.model is None))
            await asyncio.sleep(PING_INTERVAL_S)
            now = time.monotonic()
            # A wrong or unreachable address must not look like a quiet server: said once when the
            # wait starts to matter (pings go on meanwhile), and once when it ends.
            silent_s = now - max(started, self._last_pong)
            if not self.scheduler_alive and not self._said_waiting and silent_s >= WAITING_LOG_INTERVAL_S:
                self._said_waiting = True
                log.warning("waiting for the scheduler at %s: no answer for %.0f s (still trying)",
                            self._endpoints.frontend_to_scheduler, silent_s)
            # Only a silent scheduler ends the streams here: while a lost worker is restarted,
            # the scheduler keeps their requests and recomputes them.
            alive = self.scheduler_alive
            if was_alive and not alive and self.engine_error is None:
                self._fail_all("the scheduler stopped answering")
            was_alive = alive

    def _on_tokens(self, batch: TokenBatch) -> None:
        streams = self._streams
        logprobs = batch.logprobs
        for i, (rid, token) in enumerate(zip(batch.rids, batch.token_ids, strict=True)):
            stream = streams.get(rid)
            if stream is not None:
                stream.push(token, logprobs[i] if logprobs else None)
        for finish in batch.finished:
            stream = streams.get(finish.rid)
            if stream is not None:
                stream.close(finish)

    def _on_ready(self, msg: EngineReady) -> None:
        if self.model is None:
            self.model = msg.model
            log.info(
                "engine ready: model %s, %d KV blocks of %d tokens, max model len %d",
                msg.model.name,
                msg.model.num_kv_blocks,
                msg.model.block_size,
                msg.model.max_model_len,
            )
        self.ready.set()

    async def _link_loop(self) -> None:
        """The connection to the scheduler dropped (it exited, or was killed): not ready from now
        until a scheduler answers again, rather than on its last word for seconds."""
        while True:
            event = parse_monitor_message(await self._links.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.scheduler_ready = False
                self.unhealthy_reason = "the connection to the scheduler dropped; reconnecting"

    def _on_pong(self, pong: Pong) -> None:
        self._last_pong = time.monotonic()
        if self._said_waiting:
            self._said_waiting = False
            log.info("the scheduler at %s answers", self._endpoints.frontend_to_scheduler)
        if self._scheduler_epoch and pong.scheduler_epoch != self._scheduler_epoch:
            log.warning("the scheduler restarted: ending %d live requests it never heard of", len(self._streams))
            # Requests sent in the moment between its start and this pong may have reached the
            # new scheduler: abort them there too, or they would run on for nobody.
            for rid in list(self._streams):
                self.abort_soon(rid)
            self._fail_all("the scheduler restarted; the request was lost")
        self._scheduler_epoch = pong.scheduler_epoch
        self.workers_alive = pong.workers_alive
        # A scheduler that just (re)started knows no model until a worker announces itself, even
        # while that worker's heartbeats already reach it: until then it refuses requests.
        self.scheduler_ready = pong.ready
        self.unhealthy_reason = pong.unhealthy_reason
        if self.engine_error is not None and pong.ready and pong.workers_alive:
            log.info("engine recovered (was: %s)", self.engine_error)
            self.engine_error = None
        if pong.stats is not None:
            self.stats = pong.stats

    def _on_query_reply(self, reply: QueryReply) -> None:
        fut = self._queries.get(reply.query_id)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def _on_engine_error(self, msg: EngineError) -> None:
        # Before the engine was ever ready, whoever runs this frontend says it (sluice serve
        # prints one "sluice: error:" line and exits); afterwards it is news for the log.
        quiet = self.quiet_startup_errors and not self.ready.is_set()
        log.log(logging.DEBUG if quiet else logging.ERROR, "engine failed: %s", msg.message)
        self.engine_error = msg.message
        self._fail_all(msg.message)

    def _fail_all(self, message: str) -> None:
        for stream in list(self._streams.values()):
            stream.close(Finish(stream.rid, FinishReason.ERROR, 0, 0, len(stream.token_ids), message))
