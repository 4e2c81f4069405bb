"""The flags ``sluice chat`` and ``sluice complete`` share, and the request fields they become.

Imported whenever any ``sluice`` command builds its parser, so it imports nothing costly.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def server_url(text: str) -> str:
    """``--url``: a server's root. OpenAI clients are usually given ``…/v1`` as their base URL,
    so that is accepted too; the paths this client requests carry their own ``/v1``."""
    url = text.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL")
    return url.removesuffix("/v1")


def json_schema_file(text: str) -> dict[str, Any]:
    """``--json-schema``: OpenAI's ``response_format`` for the JSON schema in that file."""
    path = Path(text)
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {e.strerror}") from None
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text} is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError(f"{text} is not a JSON schema (an object)")
    name = "".join(c if c.isalnum() or c in "_-" else "_" for c in path.stem)[:64] or "schema"
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    # Most defaults here are "the server's" (the field is not sent): each help says its default.
    p.add_argument("--url", type=server_url, default="http://127.0.0.1:8000", metavar="URL",
                   help="the OpenAI-compatible server: Sluice, vLLM, llama.cpp's server, ... "
                        "(default: %(default)s)")
    p.add_argument("--model", default=None, metavar="NAME", help="model name to request (default: the first of GET /v1/models)")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="most tokens per reply (default: the server's)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="sampling temperature, 0 = greedy (default: the server's)")
    p.add_argument("--priority", type=int, default=None, metavar="P",
                   help="the request body's priority (Sluice, vLLM; on Sluice lower is more urgent and "
                        "below 0 needs --admin-token)")
    p.add_argument("--json-schema", dest="response_format", type=json_schema_file, default=None, metavar="FILE",
                   help="hold every reply to the JSON schema in FILE (sent as response_format)")
    p.add_argument("--admin-token", default=None, metavar="TOKEN",
                   help="sent as 'Authorization: Bearer TOKEN': Sluice's admin token, or a server's API key")
    p.add_argument("--stats", action="store_true",
                   help="after each reply, print on stderr the time to first token, the output rate (tokens "
                        "over the time from request to last token) and the token count")


def request_fields(args: argparse.Namespace) -> dict[str, Any]:
    """Body fields common to both endpoints. A flag left unset is not sent, so the server's own
    default applies and a server that lacks a field (``priority``) is not asked about it."""
    fields: dict[str, Any] = {"model": args.model, "stream": True}
    for name in ("max_tokens", "temperature", "priority", "response_format"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.stats:  # the token count; servers that ignore this get their chunks counted instead
        fields["stream_options"] = {"include_usage": True}
    return fields
