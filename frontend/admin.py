"""Admin API behind ``Authorization: Bearer <admin token>``.

Without a configured token every admin route answers 403 and says how to enable it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend.errors import APIError
from frontend.schemas import PriorityUpdate, decode
from frontend.state import AppState
from protocol.messages import (
    PauseAll,
    PauseRequest,
    Query,
    QueryReply,
    RequestQuery,
    RequestsQuery,
    ResetPrefixCache,
    ResumeAll,
    ResumeRequest,
    SetPriority,
    StatsQuery,
)
from protocol.process_memory import resident_mib


def require_admin(request: Request) -> AppState:
    state: AppState = request.app.state.sluice
    if not state.config.admin_token:
        raise APIError(403, "the admin API is off: start Sluice with --admin-token or SLUICE_ADMIN_TOKEN",
                       code="admin_disabled")
    if "authorization" not in request.headers:
        raise APIError(401, "missing Authorization: Bearer <admin token>", code="missing_token",
                       headers={"WWW-Authenticate": "Bearer"})
    if not state.is_admin(request):
        raise APIError(403, "wrong admin token", code="invalid_token")
    return state


async def _ask(state: AppState, msg: Query | SetPriority | PauseRequest | ResumeRequest) -> QueryReply:
    try:
        return await state.client.query(msg)
    except TimeoutError:
        raise APIError(503, "the scheduler did not answer", code="engine_down") from None


async def stats(request: Request) -> Response:
    state = require_admin(request)
    data = (await _ask(state, StatsQuery())).data
    if isinstance(data, dict):
        data |= state.metrics.frontend_stats()
        engine = data.get("process_memory")
        memory: dict[str, Any] = {"frontend": resident_mib(), **(engine if isinstance(engine, dict) else {})}
        memory["total_rss_mib"] = round(sum(m["rss_mib"] for m in memory.values()), 1)
        data["process_memory"] = memory
    return Response(msgspec.json.encode(data), media_type="application/json")


DASHBOARD = Path(__file__).parent / "static" / "dashboard.html"


async def dashboard(request: Request) -> Response:
    """The page itself is public; everything it shows comes from the token-protected API."""
    return Response(DASHBOARD.read_bytes(), media_type="text/html")


def _json(data: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(data), status_code=status, media_type="application/json")


def _rid(state: AppState, request: Request) -> tuple[str, int]:
    request_id = request.path_params["request_id"]
    rid = state.client.rid_by_id.get(request_id)
    if rid is None:
        raise APIError(404, f"no live request {request_id!r} (unknown or finished)", param="request_id",
                       code="request_not_found")
    return request_id, rid


async def list_requests(request: Request) -> Response:
    state = require_admin(request)
    data = (await _ask(state, RequestsQuery())).data
    for entry in data if isinstance(data, list) else []:
        if isinstance(entry, dict):
            entry["endpoint"] = state.client.endpoint_of(str(entry.get("id")))
    return _json({"object": "list", "data": data})


async def get_request(request: Request) -> Response:
    state = require_admin(request)
    request_id, rid = _rid(state, request)
    reply = await _ask(state, RequestQuery(rid))
    if not reply.found:
        raise APIError(404, f"no live request {request_id!r} (unknown or finished)", code="request_not_found")
    data = reply.data
    if isinstance(data, dict):
        data["endpoint"] = state.client.endpoint_of(request_id)
    return _json(data)


async def _control(state: AppState, request_id: str, msg: SetPriority | PauseRequest | ResumeRequest) -> None:
    """Send a control and return once the scheduler has applied it (a 200 means applied: the
    next read and the next step see it)."""
    if not (await _ask(state, msg)).found:
        raise APIError(404, f"no live request {request_id!r} (unknown or finished)", param="request_id",
                       code="request_not_found")


async def abort_request(request: Request) -> Response:
    state = require_admin(request)
    request_id, rid = _rid(state, request)
    await state.client.abort(rid)
    return _json({"id": request_id, "action": "abort", "status": "accepted"})


async def set_priority(request: Request) -> Response:
    state = require_admin(request)
    request_id, rid = _rid(state, request)
    body = decode(await request.body(), PriorityUpdate)
    await _control(state, request_id, SetPriority(rid, body.priority, body.cut_in))
    return _json({"id": request_id, "action": "priority", "priority": body.priority, "cut_in": body.cut_in,
                  "status": "applied"})


async def pause_request(request: Request) -> Response:
    state = require_admin(request)
    request_id, rid = _rid(state, request)
    await _control(state, request_id, PauseRequest(rid))
    return _json({"id": request_id, "action": "pause", "status": "applied"})


async def resume_request(request: Request) -> Response:
    state = require_admin(request)
    request_id, rid = _rid(state, request)
    await _control(state, request_id, ResumeRequest(rid))
    return _json({"id": request_id, "action": "resume", "status": "applied"})


async def pause_server(request: Request) -> Response:
    state = require_admin(request)
    await state.client.send_control(PauseAll())
    return _json({"action": "pause", "status": "accepted"})


async def resume_server(request: Request) -> Response:
    state = require_admin(request)
    await state.client.send_control(ResumeAll())
    return _json({"action": "resume", "status": "accepted"})


async def reset_prefix_cache(request: Request) -> Response:
    state = require_admin(request)
    await state.client.send_control(ResetPrefixCache())
    return _json({"action": "prefix-cache-reset", "status": "accepted"})


ROUTES = [
    Route("/admin/ui", dashboard, methods=["GET"]),
    Route("/admin/stats", stats, methods=["GET"]),
    Route("/admin/requests", list_requests, methods=["GET"]),
    Route("/admin/requests/{request_id}", get_request, methods=["GET"]),
    Route("/admin/requests/{request_id}/abort", abort_request, methods=["POST"]),
    Route("/admin/requests/{request_id}/priority", set_priority, methods=["POST"]),
    Route("/admin/requests/{request_id}/pause", pause_request, methods=["POST"]),
    Route("/admin/requests/{request_id}/resume", resume_request, methods=["POST"]),
    Route("/admin/pause", pause_server, methods=["POST"]),
    Route("/admin/resume", resume_server, methods=["POST"]),
    Route("/admin/prefix-cache/reset", reset_prefix_cache, methods=["POST"]),
]
