"""``sluice complete``: stream one completion of a prompt (POST /v1/completions) to stdout.

stdout gets exactly the completion's text and one newline; ``--stats``, notes and errors go to
stderr. Exit status: 0, 1 when the request failed (the server's message is printed), 130 when
Ctrl-C interrupted it (the connection is closed, so the server aborts the request).
"""

from __future__ import annotations

import argparse
import sys

from client.terminal_args import add_server_arguments, request_fields


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None, help="the text to complete (default: read from stdin)")
    add_server_arguments(p)


def run(args: argparse.Namespace) -> int:
    from client import terminal_stream as ts

    out = ts.TextOut()
    try:
        prompt = args.prompt if args.prompt is not None else sys.stdin.read()
        with ts.Server(args.url, args.admin_token) as server:
            model = args.model or server.first_model()
            reply = server.stream("/v1/completions", request_fields(args) | {"model": model, "prompt": prompt}, out)
            out("\n")
    except ts.RequestFailed as e:
        out.end_line()
        ts.error(str(e))
        return 1
    except KeyboardInterrupt:
        out.end_line()
        ts.note("[interrupted]")
        return 130
    except BrokenPipeError:
        return ts.stdout_closed()
    if args.stats:
        ts.note(reply.stats_line())
    if reply.finish_reason == "abort":  # e.g. an admin's abort or Sluice's --request-timeout
        ts.error("the server aborted the request")
        return 1
    return 0
