"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

import re

import msgspec
from starlette.responses import Response


class APIError(Exception):
    """Raised anywhere in request handling; the app turns it into a JSON error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        named = {
            401: "authentication_error",
            403: "permission_error",
            404: "not_found_error",
            503: "service_unavailable",
        }.get(self.status)
        if named is not None:
            return named
        # Any other 4xx (400, 405, 413, ...) is the client's: OpenAI calls those invalid requests.
        return "invalid_request_error" if 400 <= self.status < 500 else "server_error"

    def response(self, request_id: str | None = None) -> Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        headers = dict(self.headers)
        if request_id:
            headers["X-Request-Id"] = request_id
        return Response(
            msgspec.json.encode(body), status_code=self.status, media_type="application/json", headers=headers
        )


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


_PATH = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_MISSING = re.compile(r"missing required field `([A-Za-z_][A-Za-z0-9_]*)`")
_UNKNOWN = re.compile(r"unknown field `([A-Za-z_][A-Za-z0-9_]*)`")  # bodies that forbid them (admin)


def from_decode_error(e: msgspec.DecodeError) -> APIError:
    """msgspec names the JSON path of a bad field (``... - at `$.max_tokens```): keep the message
    and report the top-level field as ``param``."""
    text = str(e)
    if isinstance(e, msgspec.ValidationError):
        unknown = _UNKNOWN.search(text)
        if unknown and " - at `$" not in text:  # a top-level field: OpenAI's wording
            return APIError(400, f"Unrecognized request argument supplied: {unknown.group(1)}",
                            param=unknown.group(1), code="unknown_field")
        if unknown:  # inside an object (a chat message): the whole path names it
            where = text.rsplit(" - at `$.", 1)[1].rstrip("`")
            return APIError(400, f"Unrecognized field `{unknown.group(1)}` in {where}",
                            param=f"{where}.{unknown.group(1)}", code="unknown_field")
        m = _PATH.search(text) or _MISSING.search(text) or unknown
        return bad_request(text, param=m.group(1) if m else None)
    return bad_request(f"request body is not valid JSON: {text}")
