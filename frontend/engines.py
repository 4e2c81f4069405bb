"""The engines one frontend serves from (data parallelism): one ``EngineClient`` per scheduler
address, presented to the HTTP handlers as one engine.

Each request goes to one engine (``frontend.router``: by load, with prefix affinity) and stays
there; admin calls about it reach that engine, calls about the whole server reach every engine,
and ``/admin/stats`` and ``/metrics`` add the engines up and show each. An engine whose scheduler
or worker is down is out of rotation until it answers healthy again (its live requests are its
own to recover: a lost worker's are recomputed on its restart). An engine that announces another
model than the first one's is refused, by address, and never used. With one address this is a
thin shell around one client.

The clients share one epoch and one rid counter: a rid names one request across all engines.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import msgspec

from frontend.engine_client import EngineClient
from frontend.errors import APIError
from frontend.metrics import Metrics
from frontend.output import Output, RequestHandle
from frontend.router import Router
from protocol.curve import CurveKeys
from protocol.messages import (
    RID_COUNTER_BITS,
    FrontendMessage,
    ModelInfo,
    PauseRequest,
    Query,
    QueryReply,
    RequestQuery,
    RequestsQuery,
    ResumeRequest,
    SetPriority,
    StatsQuery,
    new_epoch,
)

log = logging.getLogger("sluice.frontend")

ENGINE_QUERY_TIMEOUT_S = 2.0
RATIOS = ("kv_usage", "device_idle_ratio")  # averaged over engines; every other figure is summed


def same_model(a: ModelInfo, b: ModelInfo) -> bool:
    """Whether two engines serve the same model as far as a client can tell."""
    return (a.name, a.vocab_size, a.max_model_len, a.tokenizer_json, a.dtype, a.quantization, a.kv_cache_dtype) == \
        (b.name, b.vocab_size, b.max_model_len, b.tokenizer_json, b.dtype, b.quantization, b.kv_cache_dtype)


class EngineGroup:
    def __init__(self, engines: list[EngineClient]) -> None:
        self.engines = engines
        self.router = Router(len(self.engines))
        self._said_refused: set[int] = set()
        self._refused_for: tuple[int, ...] = ()  # the announced models ``_refused`` was worked out for
        self._refused: dict[int, str] = {}
        self.failed_over = 0  # requests that continued on another engine (/admin/stats)
        if len(engines) > 1:
            for engine in engines:
                engine.failover = self._fail_over

    @classmethod
    def connect(cls, addresses: list[str], curve: CurveKeys | None = None) -> EngineGroup:
        """A client per scheduler address, sharing one epoch and rid counter."""
        epoch = new_epoch()
        rids = itertools.count((epoch << RID_COUNTER_BITS) + 1)
        return cls([EngineClient(address, curve, epoch, rids) for address in addresses])

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        for engine in self.engines:
            await engine.start()

    async def all_ready(self) -> None:
        """Until every engine has been ready once."""
        for engine in self.engines:
            await engine.ready.wait()

    @property
    def refused(self) -> dict[int, str]:
        """Engines never used, by index, and why: each whose model differs from the first
        engine's that announced one (read on every use, so no request races the check; worked
        out again only when an engine announces a model: the tokenizers compared are large)."""
        announced = [(i, e.model) for i, e in enumerate(self.engines) if e.model is not None]
        if len(announced) < 2:
            return {}
        key = tuple(id(model) for _, model in announced)
        if key != self._refused_for:
            self._refused_for, self._refused = key, self._compare(announced)
        return self._refused

    def _compare(self, announced: list[tuple[int, ModelInfo]]) -> dict[int, str]:
        base, first = announced[0]
        refused = {}
        for i, model in announced[1:]:
            if not same_model(model, first):
                refused[i] = (f"the engine at {self.engines[i].address} serves {_describe(model)}, the one at "
                              f"{self.engines[base].address} {_describe(first)}: every engine behind a frontend "
                              "must serve the same model")
                if i not in self._said_refused:
                    self._said_refused.add(i)
                    log.error("%s; not sending it requests", refused[i])
        return refused

    async def close(self) -> None:
        for engine in self.engines:
            await engine.close()

    # ----------------------------------------------------------------- state, added up

    def _usable(self) -> list[EngineClient]:
        refused = self.refused
        return [e for i, e in enumerate(self.engines) if i not in refused]

    @property
    def model(self) -> ModelInfo | None:
        return next((e.model for e in self._usable() if e.model is not None), None)

    @property
    def healthy(self) -> bool:
        return any(e.healthy for e in self._usable())

    @property
    def scheduler_alive(self) -> bool:
        return any(e.scheduler_alive for e in self._usable())

    @property
    def engine_error(self) -> str | None:
        """Why this frontend cannot serve: an engine serves another model (a deployment mistake,
        never served around: the frontend says so until it is fixed), or every engine failed."""
        if self.refused:
            return next(iter(self.refused.values()))
        errors = [e.engine_error for e in self.engines]
        return errors[0] if all(errors) else None

    @property
    def unhealthy_reason(self) -> str:
        reasons = [self._name(i) + ": " + (e.engine_error or e.unhealthy_reason or "not answering")
                   for i, e in enumerate(self.engines) if not e.healthy and i not in self.refused]
        return "; ".join(reasons) if len(self.engines) > 1 else (self.engines[0].unhealthy_reason or "")

    def _name(self, i: int) -> str:
        return f"engine {i} ({self.engines[i].address})"

    @property
    def stats(self) -> dict[str, Any] | None:
        """The engines' latest scheduler snapshots added up (ratios averaged)."""
        if len(self.engines) == 1:
            return self.engines[0].stats
        snapshots = [e.stats for e in self._usable() if e.stats is not None]
        return _add_up(snapshots) if snapshots else None

    def engine_stats(self) -> list[tuple[str, dict[str, Any]]]:
        """Each engine's latest snapshot (empty before its first) and whether it is in rotation,
        by engine number (``/metrics``)."""
        return [(str(i), (e.stats or {}) | {"in_rotation": int(self._load(i, e) is not None)})
                for i, e in enumerate(self.engines)]

    @property
    def handles(self) -> set[RequestHandle]:
        if len(self.engines) == 1:
            return self.engines[0].handles
        return set().union(*(e.handles for e in self.engines))

    @property
    def num_live(self) -> int:
        return sum(e.num_live for e in self.engines)

    @property
    def num_waiting_first_token(self) -> int:
        return sum(e.num_waiting_first_token for e in self.engines)

    def endpoint_of(self, request_id: str) -> str | None:
        """The route a live request came in by (``/v1/chat/completions``, ...); None if unknown."""
        for e in self.engines:
            rid = e.outputs.rid_by_id.get(request_id)
            choice = e.outputs.choices.get(rid) if rid is not None else None
            if choice is not None:
                return choice.output.renderer.endpoint
        return None

    @property
    def rid_by_id(self) -> dict[str, int]:
        merged: dict[str, int] = {}
        for e in self.engines:
            merged |= e.rid_by_id
        return merged

    def attach(self, metrics: Metrics, request_timeout: float, quiet_startup_errors: bool | None = None) -> None:
        for e in self.engines:
            e.outputs.metrics = metrics
            e.request_timeout = request_timeout
            if quiet_startup_errors is not None:
                e.quiet_startup_errors = quiet_startup_errors

    # ----------------------------------------------------------------- requests

    def next_rids(self, n: int = 1) -> int:
        return self.engines[0].next_rids(n)

    def _load(self, i: int, engine: EngineClient) -> float | None:
        if i in self.refused or not engine.healthy:
            return None
        stats = engine.stats or {}
        theirs = float(stats.get("running", 0) or 0) + float(stats.get("waiting", 0) or 0)
        return max(float(engine.num_live), theirs)

    async def add(self, output: Output) -> RequestHandle:
        if len(self.engines) == 1:
            return await self.engines[0].add(output)
        loads = [self._load(i, e) for i, e in enumerate(self.engines)]
        choice = self.router.choose(output.request.prompt_token_ids, loads)
        if choice is None:
            raise APIError(503, f"no engine is serving: {self.unhealthy_reason}", code="engine_down",
                           headers={"Retry-After": "1"})
        return await self.engines[choice].add(output)

    def owner(self, rid: int) -> EngineClient | None:
        """The engine running ``rid`` (a live request of this frontend), if any."""
        return next((e for e in self.engines if rid in e.outputs.choices), None)

    async def abort(self, rid: int) -> None:
        engine = self.owner(rid)
        if engine is not None:
            await engine.abort(rid)

    async def abort_all(self) -> None:
        for e in self.engines:
            await e.abort_all()

    async def query(self, msg: Query | SetPriority | PauseRequest | ResumeRequest,
                    timeout: float = 5.0) -> QueryReply:
        """A query about one request goes to its engine; stats and the request list come from
        every engine that answers, added up (``engines``: each one's own)."""
        if isinstance(msg, StatsQuery | RequestsQuery) and len(self.engines) > 1:
            # An engine that does not answer soon is reported as such: one hung engine must not
            # hold up the whole server's stats.
            wait = min(timeout, ENGINE_QUERY_TIMEOUT_S)
            replies = await asyncio.gather(*(self._ask(i, type(msg)(), wait) for i in range(len(self.engines))))
            if isinstance(msg, StatsQuery):
                return QueryReply(0, True, self._stats(replies))
            data = [dict(item, engine=i) for i, reply in enumerate(replies) if reply is not None and reply.found
                    for item in (reply.data if isinstance(reply.data, list) else [])]
            return QueryReply(0, True, data)
        rid = getattr(msg, "rid", None)
        engine = self.owner(rid) if rid is not None else None
        if engine is None and isinstance(msg, RequestQuery | SetPriority | PauseRequest | ResumeRequest):
            return QueryReply(0, False)
        return await (engine or self.engines[0]).query(msg, timeout)

    async def _ask(self, i: int, msg: Query, timeout: float) -> QueryReply | None:
        try:
            return await self.engines[i].query(msg, timeout)
        except TimeoutError:
            return None

    def _stats(self, replies: list[QueryReply | None]) -> dict[str, Any]:
        per_engine: list[dict[str, Any]] = []
        for i, reply in enumerate(replies):
            engine = self.engines[i]
            entry: dict[str, Any] = {"engine": i, "address": engine.address, "healthy": engine.healthy,
                                     "in_rotation": self._load(i, engine) is not None,
                                     "live_requests": engine.num_live}
            if i in self.refused:
                entry["refused"] = self.refused[i]
            elif not engine.healthy:
                entry["reason"] = engine.engine_error or engine.unhealthy_reason or "not answering"
            if reply is not None and isinstance(reply.data, dict):
                entry |= reply.data
            per_engine.append(entry)
        answered = [e for e in per_engine if "running" in e]
        totals = _add_up(answered) if answered else {}
        memory: dict[str, Any] = {}
        for entry in answered:
            for process, figures in (entry.get("process_memory") or {}).items():
                memory[f"engine {entry['engine']} {process}"] = figures
        totals["process_memory"] = memory
        totals["workers_alive"] = any(e.get("workers_alive") for e in answered)
        totals["engines"] = per_engine
        totals["routed_by_prefix"] = self.router.affinity_routed
        totals["routed_by_load"] = self.router.load_routed
        totals["failed_over"] = self.failed_over
        return totals

    # ----------------------------------------------------------------- failover

    def _fail_over(self, lost: EngineClient, message: str) -> None:
        """``lost`` lost its requests whole (its scheduler is gone, restarted or failed): each
        response continues on an engine in rotation, each unfinished choice recomputed there from
        its prompt and the tokens it has streamed (``AddRequest.output_token_ids``: they count as
        its output, so max_tokens, stop rules, penalties and a grammar's state carry on). The text
        goes on where it stopped; greedy text is what one engine would have given."""
        outputs = list({id(c.output): c.output for c in lost.outputs.choices.values()}.values())
        for output in outputs:
            handle = next((h for h in lost.handles if h.output is output), None)
            moving = [c for c in output.choices if c.rid in lost.outputs.choices]
            if handle is None or output.closed or not moving:
                continue
            loads = [self._load(i, e) if e is not lost else None for i, e in enumerate(self.engines)]
            choice = moving[0]
            target_index = self.router.choose([*output.request.prompt_token_ids, *choice.generated], loads)
            if target_index is None:
                return  # no engine to take them: they end with the error
            target = self.engines[target_index]
            sampling = output.request.sampling
            continued = []
            for c in moving:
                old_rid, rid = c.rid, self.next_rids(1)
                choice_offset = c.index - output.choices[0].index  # as the scheduler seeded it
                seed = (sampling.seed + choice_offset) % 2**63 if sampling.seed is not None else None
                continued.append(msgspec.structs.replace(
                    output.request, rid=rid, request_id=c.request_id, n=1, output_token_ids=list(c.generated),
                    sampling=msgspec.structs.replace(sampling, seed=seed)))
                lost.outputs.move(c, target.outputs, rid)
                lost.abort_soon(old_rid)  # in case the lost engine was only slow: it must not run on
            lost.hand_over(handle, target)
            for add in continued:
                target.send_soon(add)
            self.failed_over += 1
            log.warning("engine %d lost its requests (%s): %s continues on engine %d after %d tokens",
                        self.engines.index(lost), message, output.request.request_id, target_index,
                        len(choice.generated))

    async def send_control(self, msg: FrontendMessage) -> None:
        """A control for the whole server (pause, resume, prefix-cache reset): to every engine."""
        for e in self.engines:
            await e.send_control(msg)


def _add_up(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Several engines' figures as one server's: counts summed, ratios averaged, the prefix
    cache's hit rate recomputed, per-engine constants (the block size) and the frontends (each
    frontend talks to every engine) taken as they are."""
    total: dict[str, Any] = {}
    for key in snapshots[0]:
        values = [s.get(key) for s in snapshots]
        numbers: list[int | float] = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        if key in ("engine", "address") or len(numbers) != len(values):
            continue
        if key in RATIOS:
            total[key] = sum(numbers) / len(numbers)
        elif key in ("block_size", "frontends"):
            total[key] = max(numbers)
        else:
            total[key] = sum(numbers)
    if total.get("prefix_cache_queries"):
        total["prefix_cache_hit_rate"] = total.get("prefix_cache_hits", 0) / total["prefix_cache_queries"]
    return total


def _describe(model: ModelInfo) -> str:
    quantized = f", {model.quantization} kept quantized" if model.quantization else ""
    return f"{model.name!r} ({model.dtype or 'dtype unknown'}{quantized}, vocabulary {model.vocab_size}, " \
           f"max model len {model.max_model_len})"
