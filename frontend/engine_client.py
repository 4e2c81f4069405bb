"""The frontend's side of the ZeroMQ link to the scheduler.

One task owns the receiving socket: it decodes each ``SchedulerMessage`` and dispatches it by type.
A ``TokenBatch`` goes to the output processor (``frontend.output``), which turns it into every
stream's bytes in one loop. Token batches are numbered (``TokenBatch.seq``): a gap means output
was lost on the link, and every live stream of this frontend ends with an error (any of them may
have lost tokens) and is aborted in the scheduler. The socket tasks are watched: one that dies
is logged, ends the live streams with an error, and is started again.

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
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from frontend.output import Output, OutputProcessor, RequestHandle
from protocol.curve import CurveKeys
from protocol.messages import (
    RID_COUNTER_BITS,
    AbortRequest,
    EngineError,
    EngineReady,
    FrontendMessage,
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


class EngineClient:
    def __init__(self, address: str, curve: CurveKeys | None = None, epoch: int | None = None,
                 rids: Iterator[int] | None = None) -> None:
        """``epoch`` and ``rids``: shared by the engines of one frontend (``frontend.engines``),
        so its rids are unique across them; by default this client's own."""
        self.address = address
        self._endpoints = Endpoints.from_base(address)
        self._curve = curve
        self._ctx = zmq.asyncio.Context()
        self._codec = frontend_codec()
        self.outputs = OutputProcessor(self.abort_soon)
        self.handles: set[RequestHandle] = set()  # responses in flight
        self._deadlines: dict[RequestHandle, asyncio.TimerHandle] = {}
        self.request_timeout = 0.0  # seconds from arrival (--request-timeout); 0 = none
        self._expected_seq = 1
        self._closing = False
        self._queries: dict[int, asyncio.Future[QueryReply]] = {}
        self.epoch = new_epoch() if epoch is None else epoch
        self._rids = itertools.count((self.epoch << RID_COUNTER_BITS) + 1) if rids is None else rids
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
        # Set by ``frontend.engines`` when other engines can take over: called with this client
        # and the reason before its live requests would end with an error (what it moves on
        # continues elsewhere).
        self.failover: Callable[[EngineClient, str], None] | None = None
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
        self._tasks = [self._watched(loop) for loop in (self._receive_loop, self._ping_loop, self._link_loop)]

    def _watched(self, loop: Callable[[], Coroutine[Any, Any, None]]) -> asyncio.Task[None]:
        """Run ``loop`` as a task that is started again if it dies: a socket task that ended
        unnoticed would leave every stream waiting forever."""
        task = asyncio.create_task(loop(), name=f"engine{loop.__name__}")

        def done(task: asyncio.Task[None]) -> None:
            if self._closing or task.cancelled():
                return
            error = task.exception()
            log.error("the frontend's %s task died (%r); ending live streams and starting it again",
                      loop.__name__.strip("_"), error, exc_info=error)
            self._fail_all(f"the frontend's link to the scheduler failed: {error!r}")
            self._tasks[self._tasks.index(task)] = self._watched(loop)

        task.add_done_callback(done)
        return task

    async def close(self) -> None:
        self._closing = True
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
        """Responses in flight."""
        return len(self.handles)

    @property
    def num_waiting_first_token(self) -> int:
        return self.outputs.num_waiting_first_token

    @property
    def rid_by_id(self) -> dict[str, int]:
        """Live requests' public ids, for the admin API."""
        return self.outputs.rid_by_id

    # ----------------------------------------------------------------- requests

    def next_rids(self, n: int = 1) -> int:
        """``n`` consecutive rids for one request's choices; returns the first."""
        first = next(self._rids)
        for _ in range(n - 1):
            next(self._rids)
        return first

    async def add(self, output: Output) -> RequestHandle:
        """Send ``output``'s request; the handle it returns owns it from now on (leaving it aborts
        whatever still runs)."""
        handle = RequestHandle(output, self._release)
        self.outputs.add(output)
        self.handles.add(handle)
        if self.request_timeout > 0:
            loop = asyncio.get_running_loop()
            self._deadlines[handle] = loop.call_at(loop.time() + self.request_timeout, self._timed_out, output)
        try:
            await self._send(output.request)
        except BaseException:
            await self._release(output, handle)
            raise
        return handle

    def _timed_out(self, output: Output) -> None:
        """Out of time: the aborts' finishes arrive like any other and end the response with
        finish_reason "abort" and this reason."""
        output.abort_reason = f"the request took longer than {self.request_timeout:g} s (--request-timeout)"
        for choice in output.choices:
            if not choice.ended and not choice.abort_sent:
                choice.abort_sent = True
                self.abort_soon(choice.rid)

    async def _release(self, output: Output, handle: RequestHandle | None = None) -> None:
        handle = handle or next((h for h in self.handles if h.output is output), None)
        if handle is not None:
            self.handles.discard(handle)
            timer = self._deadlines.pop(handle, None)
            if timer is not None:
                timer.cancel()
        for rid in self.outputs.release(output):
            await self._send(AbortRequest(rid))

    async def abort(self, rid: int) -> None:
        """Ask the scheduler to end ``rid``; its Finish(abort) arrives like any other finish."""
        await self._send(AbortRequest(rid))

    def abort_soon(self, rid: int) -> None:
        """``abort`` from a place that cannot await (the output processor, a timer)."""
        self.send_soon(AbortRequest(rid))

    async def abort_all(self) -> None:
        """Abort every live request (shutting down): each ends with a ``Finish(abort)``."""
        for rid in list(self.outputs.choices):
            await self._send(AbortRequest(rid))

    async def query(self, msg: Query | SetPriority | PauseRequest | ResumeRequest,
                    timeout: float = 5.0) -> QueryReply:
        """Send a query, or a control that wants its answer (``found``: the request was live
        and the change applied), and wait for the reply. Raises ``TimeoutError`` if the
        scheduler does not answer."""
        qid = next(self._query_ids)
        msg.query_id = qid
        fut: asyncio.Future[QueryReply] = asyncio.get_running_loop().create_future()
        self._queries[qid] = fut
        try:
            await self._send(msg)
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._queries.pop(qid, None)

    async def send_control(self, msg: FrontendMessage) -> None:
        await self._send(msg)

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
                self._fail_all("the scheduler stopped answering", recoverable=True)
            was_alive = alive

    def _on_tokens(self, batch: TokenBatch) -> None:
        seq = batch.seq
        if seq != self._expected_seq and seq != 1:  # 1: a (re)started scheduler's first batch
            self._lost_output(self._expected_seq, seq)
        self._expected_seq = seq + 1
        self.outputs.process(batch)

    def _lost_output(self, expected: int, got: int) -> None:
        live = len(self.handles)
        log.error("output from the scheduler was lost on the link (batch %d expected, the scheduler is at %d): "
                  "ending the %d live streams, which may have missed tokens, with an error", expected, got, live)
        metrics = self.outputs.metrics
        if metrics is not None:
            metrics.output_gaps.inc()
            metrics.streams_lost.inc(live)
        self._fail_all("output was lost on the link between the frontend and the scheduler; the request was "
                       "ended (retry it)")

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
            log.warning("the scheduler restarted: ending %d live requests it never heard of", len(self.outputs))
            # Requests sent in the moment between its start and this pong may have reached the
            # new scheduler: they are aborted there too, or they would run on for nobody.
            self._fail_all("the scheduler restarted; the request was lost", recoverable=True)
            self._expected_seq = pong.last_batch + 1
        elif pong.last_batch >= self._expected_seq:
            # Batches sent before this pong that never arrived, with none after them to show it.
            self._lost_output(self._expected_seq, pong.last_batch)
            self._expected_seq = pong.last_batch + 1
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
        self._fail_all(msg.message, recoverable=True)

    def _fail_all(self, message: str, recoverable: bool = False) -> None:
        """Every live response ends with an error, and its requests are aborted in the scheduler
        (it may be alive after all, only slow or cut off for a while: they must not run on).
        ``recoverable``: the engine lost them whole (it is gone, or restarted), so another engine
        may take them over first (``failover``); not when tokens were lost on the way."""
        if recoverable and self.failover is not None and len(self.outputs):
            self.failover(self, message)
        for rid in self.outputs.fail_all(message):
            self.abort_soon(rid)

    def hand_over(self, handle: RequestHandle, to: EngineClient) -> None:
        """``handle``'s response continues on ``to`` (its choices already moved there): so does
        its release, and its deadline."""
        self.handles.discard(handle)
        to.handles.add(handle)
        handle.rebind(to._release)
        timer = self._deadlines.pop(handle, None)
        if timer is not None:
            timer.cancel()
            to._deadlines[handle] = asyncio.get_running_loop().call_at(timer.when(), to._timed_out, handle.output)

    def send_soon(self, msg: FrontendMessage) -> None:
        """``_send`` from a place that cannot await."""
        task = asyncio.get_running_loop().create_task(self._send(msg))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
