"""``sluice chat``: a multi-turn chat in the terminal, each reply streamed as it is generated.

Every line read is sent with the whole conversation so far (POST /v1/chat/completions); the
reply goes to stdout, plain. Lines starting with a command word are commands: ``/reset`` clears
the history, ``/system TEXT`` sets the system message (``/system`` alone removes it) and clears
the history, ``/exit`` or end of input (Ctrl-D) leaves.

A turn joins the history only once its reply has arrived whole. A reply interrupted with Ctrl-C
(its request is aborted: closing the connection tells the server), cut by an error or aborted
by the server is dropped together with the message that asked for it: the next message is sent
after the conversation as it was, never after a half answer, and never as a second user
message in a row, which some chat templates refuse. Ctrl-C at the prompt, or a second one
before the first is dealt with, leaves with status 130.

Keys typed while a reply streams are kept out of it (``client.typeahead``): lines ended with Enter
are sent after it, in order, and the line being typed waits at the next prompt.

With stdin not a terminal (``printf 'hi\\n' | sluice chat``) there is no prompt and no line
editing: stdout holds just the replies, one newline after each.

A reasoning model's thinking (``delta.reasoning_content``) is shown as it streams, set apart from
the answer (``terminal_stream.TextOut``): dim and italic on a terminal; with stdout not a
terminal, on stderr with each line begun ``thinking: ``. It is not kept in the history: the next
request carries each past answer's content alone, as OpenAI's clients send it back.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass, field

from client import typeahead
from client.terminal_args import add_server_arguments, request_fields

HINT = "/reset clears the history, /system TEXT sets the system message, /exit or Ctrl-D leaves"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_server_arguments(p)
    p.add_argument("--system", default=None, metavar="TEXT", help="the system message the conversation starts with")
    p.epilog = f"While chatting: {HINT}."


@dataclass
class Conversation:
    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)  # user and assistant messages, alternating

    def messages(self, user: str) -> list[dict[str, str]]:
        """What to send for a new user message: the history is extended only by ``keep``."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.turns, {"role": "user", "content": user}]

    def keep(self, user: str, reply: str) -> None:
        self.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]


def run(args: argparse.Namespace) -> int:
    from client import terminal_stream as ts

    interactive = sys.stdin.isatty()
    if interactive:
        with contextlib.suppress(ImportError):  # not on every platform
            import readline  # noqa: F401  - importing it gives input() line editing and history
    conversation = Conversation(system=args.system)
    out = ts.TextOut()
    ahead = typeahead.Typed()  # what was typed while the last reply streamed
    try:
        with ts.Server(args.url, args.admin_token) as server:
            model = args.model or server.first_model()
            if interactive:
                ts.note(f"{model} at {args.url}: {HINT}")
            while True:
                if ahead.lines:  # sent with Enter during the last reply: shown as if typed now
                    line = ahead.lines.pop(0)
                    print(f"> {line}", flush=True)
                else:
                    try:
                        line = _read_line(interactive, ahead.partial).strip()
                    except EOFError:
                        if interactive:
                            print()  # the shell's prompt on a line of its own, not after ours
                        return 0
                    ahead.partial = ""
                if not line:
                    continue
                word, _, rest = line.partition(" ")
                if word == "/exit":
                    return 0
                if word == "/reset":
                    conversation.turns.clear()
                    ts.note("[history cleared]")
                    continue
                if word == "/system":
                    conversation = Conversation(system=rest.strip() or None)
                    ts.note(f"[system message {'set' if conversation.system else 'removed'}, history cleared]")
                    continue
                body = request_fields(args) | {"model": model, "messages": conversation.messages(line)}
                keys = typeahead.held(sys.stdin.fileno(), ahead) if interactive else contextlib.nullcontext()
                try:
                    with keys:
                        reply = server.stream("/v1/chat/completions", body, out, out.thought)
                    out.end_reply()
                except ts.RequestFailed as e:  # the server's message; the chat goes on
                    out.end_line()
                    ts.error(str(e))
                    continue
                except KeyboardInterrupt:
                    out.end_line()
                    ts.note("[interrupted]")
                    continue
                if args.stats:
                    ts.note(reply.stats_line())
                if reply.finish_reason == "abort":  # e.g. an admin's abort or Sluice's --request-timeout
                    ts.error("the server aborted the reply; it is not kept")
                    continue
                conversation.keep(line, reply.text)
    except ts.RequestFailed as e:  # looking up the model: nothing to chat with
        ts.error(str(e))
        return 1
    except KeyboardInterrupt:
        if interactive:
            print(file=sys.stderr)  # after the ^C the terminal echoed at the prompt
        return 130
    except BrokenPipeError:
        return ts.stdout_closed()


def _read_line(interactive: bool, typed: str) -> str:
    """The next line from the user; on a terminal, with ``typed`` (keys typed while the last
    reply streamed) already on the line, to edit or send."""
    if not interactive:
        return input("")
    try:
        import readline
    except ImportError:  # not on every platform: the keys are said rather than lost
        if typed:
            from client import terminal_stream as ts

            ts.note(f"[typed during the reply: {typed}]")
        return input("> ")
    readline.set_startup_hook(lambda: readline.insert_text(typed))
    try:
        return input("> ")
    finally:
        readline.set_startup_hook(None)
