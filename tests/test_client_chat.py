"""``sluice complete`` and ``sluice chat`` against a real ``sluice serve`` (tiny model): streamed
text, history, Ctrl-C aborting the request on the server, errors. The chat runs in a
pseudo-terminal, as a user runs it."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pexpect
import pytest
from paced_server import PacedServer, paced_server
from sluice_server import SluiceServer, free_port, running_server

REPO = Path(__file__).resolve().parents[1]
TOKEN = "chat-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STATS = r"\[ttft \d+\.\d\d s, \d+\.\d tok/s, (\d+) tokens\]"
FINISHED = re.compile(r"finished id=(\S+) .*? prompt_tokens=(\d+) completion_tokens=(\d+) .*? finish_reason=(\w+)")
T = TypeVar("T")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    with running_server("--admin-token", TOKEN, log_dir=tmp_path_factory.mktemp("client-chat")) as s:
        yield s


def sluice(*args: str) -> subprocess.CompletedProcess[bytes]:
    """A client command with stdout and stderr piped; bytes, as the model's text may hold any."""
    return subprocess.run([sys.executable, "-m", "frontend", *args], capture_output=True, cwd=REPO,
                          env=dict(os.environ, PYTHONIOENCODING="utf-8"), timeout=60)


def spawn_chat(server: SluiceServer | PacedServer, *flags: str) -> pexpect.spawn:
    # Ctrl-C as a terminal gives it: a test run started in the background (SIGINT ignored, which
    # children inherit) would otherwise spawn a chat that no Ctrl-C can reach.
    child = pexpect.spawn(sys.executable, ["-m", "frontend", "chat", "--url", server.url, *flags], cwd=str(REPO),
                          encoding="utf-8", codec_errors="replace", timeout=30, dimensions=(40, 250),
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    child.expect("> ")
    return child


def wait_for(probe: Callable[[], T | None], timeout: float = 20.0) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def finished(server: SluiceServer) -> list[tuple[str, int, int, str]]:
    """(id, prompt_tokens, completion_tokens, finish_reason) of each request the server's log
    says has finished, in order."""
    return [(m[1], int(m[2]), int(m[3]), m[4]) for m in FINISHED.finditer(server.log_path.read_text())]


def finish_of(server: SluiceServer, request_id: str) -> tuple[int, str] | None:
    """(completion_tokens, finish_reason) of a request, once the server's log says it finished."""
    return next(((c, r) for rid, _, c, r in finished(server) if rid == request_id), None)


def finished_chats(server: SluiceServer, known: set[str], count: int) -> list[tuple[str, int, int, str]]:
    """The first ``count`` chat requests to finish that are not in ``known``, once they have."""
    def new() -> list[tuple[str, int, int, str]] | None:
        chats = [f for f in finished(server) if f[0].startswith("chatcmpl-") and f[0] not in known]
        return chats[:count] if len(chats) >= count else None
    return wait_for(new)


def live_requests(server: SluiceServer) -> list[dict]:
    return httpx.get(f"{server.url}/admin/requests", headers=AUTH, timeout=10).json()["data"]


def chat_prompt_tokens(server: SluiceServer, messages: list[dict[str, str]]) -> int:
    """What a conversation costs in prompt tokens, asked of the server directly."""
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=30)
    return int(r.json()["usage"]["prompt_tokens"])


def test_client_modules_import_nothing_costly() -> None:
    # Every `sluice` command, `serve` included, imports these to build its parser.
    code = ("import sys, client.chat, client.complete; "
            "print(sorted(m for m in ('httpx', 'rich') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


def test_complete_streams_the_greedy_completion_and_stats(server: SluiceServer) -> None:
    prompt = "The quick brown fox"
    done = sluice("complete", "--url", server.url, prompt, "--max-tokens", "8", "--temperature", "0", "--stats")
    assert done.returncode == 0, done.stderr
    reference = httpx.post(f"{server.url}/v1/completions", timeout=30,
                           json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
    assert reference["choices"][0]["text"]
    assert done.stdout.decode() == reference["choices"][0]["text"] + "\n"
    stats = re.fullmatch(STATS + "\n", done.stderr.decode())
    assert stats, done.stderr
    assert int(stats[1]) == reference["usage"]["completion_tokens"]


def test_json_schema_holds_the_reply_to_the_schema_in_a_file(server: SluiceServer, tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}, "n": {"type": "integer",
              "minimum": 0, "maximum": 9}}, "required": ["colour", "n"], "additionalProperties": False}
    path = tmp_path / "shape.json"
    path.write_text(json.dumps(schema))
    done = sluice("complete", "--url", server.url, "Reply in JSON:", "--json-schema", str(path), "--max-tokens", "40",
                  "--temperature", "0")
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout.decode())
    assert reply["colour"] in ("red", "blue") and 0 <= reply["n"] <= 9 and set(reply) == {"colour", "n"}
    path.write_text("{not json")
    bad = sluice("chat", "--url", server.url, "--json-schema", str(path))
    assert bad.returncode == 2 and b"is not JSON" in bad.stderr


def test_chat_sends_the_history_and_reset_and_system_change_it(server: SluiceServer) -> None:
    known = {f[0] for f in finished(server)}
    child = spawn_chat(server, "--max-tokens", "6", "--temperature", "0", "--stats")
    screens = []
    for line in ["hello", "hello", "/reset", "hello", "/system Answer in French.", "hello"]:
        child.sendline(line)
        if line == "/reset":
            child.expect_exact("[history cleared]")
        elif line.startswith("/system"):
            child.expect_exact("[system message set, history cleared]")
        else:
            child.expect(STATS)
            screens.append(child.before)
        child.expect("> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0

    chats = finished_chats(server, known, 4)
    prompt_tokens = [p for _, p, _, _ in chats]
    assert [reason for *_, reason in chats] == ["length"] * 4
    # Greedy decoding: the chat's first reply is the server's reply to the same single message.
    first = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}).json()
    reply = first["choices"][0]["message"]["content"]
    assert reply.replace("\n", "\r\n") in screens[0]  # streamed to the terminal as sent
    hello = {"role": "user", "content": "hello"}
    assert prompt_tokens == [
        chat_prompt_tokens(server, [hello]),
        chat_prompt_tokens(server, [hello, {"role": "assistant", "content": reply}, hello]),  # the history
        chat_prompt_tokens(server, [hello]),  # /reset
        chat_prompt_tokens(server, [{"role": "system", "content": "Answer in French."}, hello]),  # /system
    ]
    assert prompt_tokens[1] > prompt_tokens[0]


def test_ctrl_c_aborts_the_reply_on_the_server_and_a_second_one_exits_130(server: SluiceServer) -> None:
    # Greedy, the tiny model does not stop before --max-tokens: a reply of many seconds.
    child = spawn_chat(server, "--max-tokens", "8000", "--temperature", "0")
    asked = []
    for _ in range(2):
        child.sendline("hello")
        child.expect(r"hello[^\n]*\n")  # the echo, and whatever readline adds to end the line
        child.expect(".")  # the reply is on the screen...
        (request,) = wait_for(lambda: live_requests(server))  # ...while the server is still generating it
        asked.append(request)
        child.sendintr()
        child.expect_exact("[interrupted]")
        child.expect("> ")
        # The client closed the connection: the server aborted the request and let it go.
        wait_for(lambda: not live_requests(server), timeout=10)
        completion_tokens, reason = wait_for(functools.partial(finish_of, server, request["id"]))
        assert reason == "abort" and completion_tokens < 8000
    # The interrupted turn was not kept: the second "hello" went out alone, like the first.
    assert asked[1]["prompt_tokens"] == asked[0]["prompt_tokens"] == chat_prompt_tokens(
        server, [{"role": "user", "content": "hello"}])
    child.sendintr()  # at the prompt: leave
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130


def test_http_errors_show_the_servers_message(server: SluiceServer) -> None:
    # priority < 0 needs the admin token, which neither command is given here.
    done = sluice("complete", "--url", server.url, "hi", "--priority", "-1")
    assert done.returncode == 1 and done.stdout == b""
    assert done.stderr.decode() == ("sluice: error: HTTP 403: priority below 0 (more urgent than default) "
                                    "requires the admin token\n")
    child = spawn_chat(server, "--priority", "-1")
    child.sendline("hello")
    child.expect_exact("HTTP 403: priority below 0")
    child.expect("> ")  # the chat goes on
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    # The token makes the same request pass.
    done = sluice("complete", "--url", server.url, "hi", "--priority", "-1", "--admin-token", TOKEN,
                  "--max-tokens", "2")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("command", [["complete", "hi"], ["chat"]])
def test_an_unreachable_server_is_one_line_and_exit_1(command: list[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    done = sluice(command[0], "--url", url, *command[1:])
    assert done.returncode == 1
    assert done.stdout == b""
    assert re.fullmatch(rf"sluice: error: cannot reach {re.escape(url)}: .*Connection refused.*\n",
                        done.stderr.decode()), done.stderr


def test_text_typed_while_a_reply_streams_waits_at_the_next_prompt() -> None:
    """Keys typed during a reply are not echoed into it, and come back at the next prompt, ready
    to edit or send. Before: the terminal echoed them into the reply's text, and they were lost."""
    with paced_server(ttft=0.1, itl=0.1) as paced:
        child = spawn_chat(paced, "--max-tokens", "30")  # 3 s of reply
        child.sendline("first")
        child.expect_exact(" t1")  # the reply is streaming
        child.send("typed ahead")
        child.expect_exact("> ")  # the next prompt, after the reply's last token
        reply = child.before
        assert " t29" in reply and "typed" not in reply, reply
        child.expect_exact("typed ahead")  # put back at the prompt
        child.sendline("")  # Enter sends it
        wait_for(lambda: len(paced.bodies) == 2)
        assert paced.bodies[1]["messages"][-1] == {"role": "user", "content": "typed ahead"}
        # A line ended with Enter during a reply is sent after it, as a shell runs type-ahead; the
        # line after it waits at the prompt (line editing applied: backspace, arrow keys dropped).
        child.expect_exact(" t1")
        child.send("sent next\rstill typ\x7f\x7fyping\x1b[D")
        child.expect_exact("> sent next")
        wait_for(lambda: len(paced.bodies) == 3)
        assert paced.bodies[2]["messages"][-1] == {"role": "user", "content": "sent next"}
        child.expect_exact(" t29")
        child.expect_exact("> ")
        child.expect_exact("still typing")
        # It is the line being edited: Ctrl-U clears it. (Keys, not Ctrl-C: a SIGINT landing while
        # readline sets up the prompt waits for the next key.)
        child.send("\x15/exit\r")
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0
        assert len(paced.bodies) == 3  # "/exit" was a command, and nothing else was sent


def test_a_reasoning_models_thinking_is_shown_apart_and_not_sent_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """``delta.reasoning_content`` streams before the answer: dim and italic on a terminal, the
    answer after a blank line; piped (or on a terminal without styles), on stderr, each line
    marked, stdout keeping the replies. The history carries each answer alone. Before: only
    ``delta.content`` was shown, and a reasoning model's answer came after a silent wait."""
    dim = "".join(f"\x1b[2;3m r{i}\x1b[0m" for i in range(3))
    with paced_server(ttft=0.05, itl=0.02, thinking=3) as paced:  # " r0 r1 r2", then " t3 t4 t5"
        for term, screen in (("xterm", f"{dim}\r\n\r\n"), ("dumb", "thinking:  r0 r1 r2\r\n")):
            monkeypatch.setenv("TERM", term)
            child = spawn_chat(paced, "--max-tokens", "6")
            child.sendline("first")
            child.expect_exact("first")
            child.expect_exact("> ")
            assert child.before == f"\r\n{screen} t3 t4 t5\r\n", term
            child.sendline("/exit")
            child.expect(pexpect.EOF)
            child.close()
            assert child.exitstatus == 0

        piped = subprocess.run([sys.executable, "-m", "frontend", "chat", "--url", paced.url, "--max-tokens", "6"],
                               input=b"first\nsecond\n", capture_output=True, cwd=REPO, timeout=60)
        assert piped.returncode == 0, piped.stderr
        assert piped.stdout == b" t3 t4 t5\n" * 2
        assert piped.stderr == b"thinking:  r0 r1 r2\n" * 2
        assert paced.bodies[-1]["messages"] == [{"role": "user", "content": "first"},
                                                {"role": "assistant", "content": " t3 t4 t5"},
                                                {"role": "user", "content": "second"}]
