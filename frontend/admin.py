"""Admin API behind ``Authorization: Bearer <admin token>``.

Without a configured token every admin route answers 403 and says how to enable it.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.errors import APIError
from frontend.state import AppState


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


async def _ask(state: AppState, what: str, rid: int = -1) -> object:
    try:
        reply = await state.client.query(what, rid)
    except TimeoutError:
        raise APIError(503, "the scheduler did not answer", code="engine_down") from None
    return reply.data


async def stats(request: Request) -> Response:
    state = require_admin(request)
    data = await _ask(state, "stats")
    return Response(msgspec.json.encode(data), media_type="application/json")
