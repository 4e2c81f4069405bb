"""What the soak sends: the greedy prompts whose undisturbed outputs every later greedy request is
compared with, the hostile requests (each must be a 4xx), and the ``Record`` of everything seen
of one request (scripts/soak.py)."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from soak_server import AUTH

VOCAB = 512  # the tiny model's; token ids 3.. are ordinary tokens


@dataclasses.dataclass
class Reference:
    """A greedy request and its undisturbed output."""

    chat: bool
    body: dict[str, Any]
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)


def greedy_references() -> list[Reference]:
    shared = [1, *((17 * j + 5) % (VOCAB - 3) + 3 for j in range(40))]  # a prefix several prompts share
    refs = []
    for i in range(6):
        suffix = [(31 * i + 7 * j) % (VOCAB - 3) + 3 for j in range(5 + 3 * i)]
        refs.append(Reference(False, {"prompt": shared + suffix, "max_tokens": (16, 48, 96, 400, 32, 64)[i]}))
    for i, length in enumerate((8, 30, 120, 250)):
        prompt = [1, *((13 * i + 11 * j + 3) % (VOCAB - 3) + 3 for j in range(length))]
        refs.append(Reference(False, {"prompt": prompt, "max_tokens": (1500, 24, 80, 800)[i]}))
    for i, text in enumerate(("The quick brown fox", "Once upon a time there was",
                              "Inference servers batch requests and")):
        refs.append(Reference(False, {"prompt": text, "max_tokens": (40, 120, 64)[i]}))
    for i, text in enumerate(("Hello!", "Tell me about ZeroMQ sockets.", "Count: one, two, three")):
        refs.append(Reference(True, {"messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": text}],
                                     "max_tokens": (32, 72, 300)[i]}))
    for ref in refs:
        ref.body |= {"temperature": 0, "ignore_eos": True}
    return refs


def path_of(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


# Each: (what, method, path, raw body or None, json body or None, extra headers).
HOSTILE: list[tuple[str, str, str, bytes | None, Any, dict[str, str]]] = [
    ("truncated JSON", "POST", "/v1/completions", b'{"prompt": "x", "max_tokens": ', None, {}),
    ("not JSON", "POST", "/v1/completions", b"\xff\xfe<html>", None, {}),
    ("JSON array body", "POST", "/v1/chat/completions", b"[1, 2, 3]", None, {}),
    ("empty body", "POST", "/v1/completions", b"", None, {}),
    ("no prompt", "POST", "/v1/completions", None, {"max_tokens": 4}, {}),
    ("empty prompt", "POST", "/v1/completions", None, {"prompt": []}, {}),
    ("prompt id out of vocab", "POST", "/v1/completions", None, {"prompt": [1, 10**6]}, {}),
    ("negative token id", "POST", "/v1/completions", None, {"prompt": [1, -3]}, {}),
    ("max_tokens 0", "POST", "/v1/completions", None, {"prompt": "x", "max_tokens": 0}, {}),
    ("max_tokens a string", "POST", "/v1/completions", None, {"prompt": "x", "max_tokens": "ten"}, {}),
    ("max_tokens past the context", "POST", "/v1/completions", None, {"prompt": "x", "max_tokens": 10**9}, {}),
    ("temperature -1", "POST", "/v1/completions", None, {"prompt": "x", "temperature": -1}, {}),
    ("top_p 0", "POST", "/v1/completions", None, {"prompt": "x", "top_p": 0}, {}),
    ("n 0", "POST", "/v1/completions", None, {"prompt": "x", "n": 0}, {}),
    ("n 1000", "POST", "/v1/completions", None, {"prompt": "x", "n": 1000}, {}),
    ("logprobs 99", "POST", "/v1/completions", None, {"prompt": "x", "logprobs": 99}, {}),
    ("logit_bias bad key", "POST", "/v1/completions", None, {"prompt": "x", "logit_bias": {"²": 1}}, {}),
    ("min_tokens > max_tokens", "POST", "/v1/completions", None,
     {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, {}),
    ("echo", "POST", "/v1/completions", None, {"prompt": "x", "echo": True}, {}),
    ("unknown model", "POST", "/v1/completions", None, {"prompt": "x", "model": "gpt-9"}, {}),
    ("priority < 0 without the token", "POST", "/v1/completions", None, {"prompt": "x", "priority": -5}, {}),
    ("stream not a bool", "POST", "/v1/completions", None, {"prompt": "x", "stream": "yes"}, {}),
    ("chat without messages", "POST", "/v1/chat/completions", None, {"messages": []}, {}),
    ("chat message not an object", "POST", "/v1/chat/completions", None, {"messages": ["hi"]}, {}),
    ("chat image part", "POST", "/v1/chat/completions", None,
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, {}),
    ("unknown route", "POST", "/v1/embeddings", None, {"input": "x"}, {}),
    ("admin without the token", "GET", "/admin/requests", None, None, {}),
    ("admin with a wrong token", "POST", "/admin/pause", None, None, {"Authorization": "Bearer wrong"}),
    ("admin priority not an int", "POST", "/admin/requests/cmpl-nope/priority", None,
     {"priority": "high"}, AUTH),
]


@dataclasses.dataclass
class Record:
    """One request and everything seen of it."""

    seq: int
    kind: str  # greedy, greedy-nonstream, sampled, disconnect, hostile
    started: float
    ref: int | None = None
    n: int = 1
    stream: bool = True
    chat: bool = False
    disconnect_after: int | None = None  # chunks read before the client hangs up
    request_id: str | None = None
    status: int | None = None
    error_code: str | None = None
    ended: float | None = None
    finishes: dict[int, list[str]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    token_ids: dict[int, list[int]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    text: dict[int, str] = dataclasses.field(default_factory=lambda: collections.defaultdict(str))
    errors: list[str] = dataclasses.field(default_factory=list)
    done_count: int = 0
    after_end: bool = False  # tokens (or another finish) after a finish, an error or [DONE]
    disconnected: bool = False
    admin_aborted: bool = False
    admin_touched: bool = False
    exception: str | None = None
    outcome: str = ""
