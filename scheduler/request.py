"""A request as the scheduler sees it. The request owns its state; others use its methods."""

from __future__ import annotations

import enum
import functools
import hashlib
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from protocol.messages import AddRequest, NewRequest, SamplingParams
from protocol.stop import stop_reason

if TYPE_CHECKING:
    from scheduler.block_pool import BlockPool

# Prefix caching. A full block's *link* is its parent block's key (``ROOT_KEY`` for the first
# block) followed by its token ids as little-endian int64s; its *key* is the sha256 of its link: a
# collision-resistant digest of the whole prefix, so one tenant cannot make its blocks' keys equal
# another's and be served that KV (keys were Python's ``hash()``: 64 bits, built from each id's
# ``hash()``, so colliding token blocks can be made; vLLM's CVE-2025-25183). Links are fixed width,
# so different (parent, block) pairs never give equal bytes. The pool finds a cached block by its
# link, compared byte for byte, and knows its key: a prefix hit costs a lookup, and only blocks
# the cache did not have are hashed.
#
# Per 16-token block on the dev VM (OpenSSL with SHA-NI): sha256 0.75 us; blake2b (digest_size=16,
# keyed) 1.14 us, its constructor costs more; CPython's own ``_sha256`` 1.14 us; packing block by
# block instead of all blocks at once 0.84 us, with ``array('q')`` instead of ``struct`` 1.18 us.
# ``hash()`` of a tuple was 0.35 us.
ROOT_KEY = b""
_INT64_BYTES = 8


def _common_blocks(a: list[int], b: list[int], block_size: int, most: int) -> int:
    """How many leading blocks of ``block_size`` tokens (at most ``most``) ``a`` and ``b`` share:
    the whole span at once first (prompts sharing a prefix mostly share all of it), then halving."""
    most = min(most, len(a) // block_size, len(b) // block_size)
    if a[: most * block_size] == b[: most * block_size]:
        return most
    lo, hi = 0, most - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * block_size] == b[: mid * block_size]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@functools.cache
def _packer(num_tokens: int) -> Callable[..., bytes]:
    """Packs ``num_tokens`` token ids, its format compiled once (compiling it each time costs
    more than packing a block). Only whole blocks are packed: a few hundred lengths at most."""
    return struct.Struct(f"<{num_tokens}q").pack


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after losing its blocks (or with them swapped out)
    PAUSED = "paused"
    FINISHED = "finished"


class Request:
    """Token bookkeeping: ``token_ids`` = prompt + outputs; ``num_computed`` of them have their
    KV in the cache (or will have, once the plan in flight runs).

    Its state changes only through the transitions below, which keep these invariants:

    * RUNNING: ``blocks`` covers at least ``num_computed`` tokens;
    * WAITING / PREEMPTED: no device blocks; a swapped-out request's KV is in ``host_blocks``;
    * PAUSED: blocks kept while memory allows (``drop_kv`` takes them back);
    * FINISHED: no blocks of any kind.

    ``on_worker``: the worker holds its state (its tokens and the first ``worker_blocks`` of
    ``blocks``), so a plan sends it deltas rather than the whole request.

        WAITING ──admit──▶ RUNNING ──preempt / swap_out──▶ PREEMPTED ──admit──▶ RUNNING
        any live ──pause──▶ PAUSED ──resume──▶ RUNNING (blocks kept) or back in line
        any live ──finish──▶ FINISHED
    """

    __slots__ = (
        "after", "arrival_time", "block_keys", "blocks", "host_blocks", "may_stop", "num_cached_tokens",
        "num_computed", "num_preemptions", "num_prompt_tokens", "on_worker", "priority", "quiet_until",
        "request_id", "rid", "sampling", "scheduled_at", "status", "token_ids", "user", "worker_blocks",
    )  # fmt: skip

    def __init__(self, msg: AddRequest, choice: int = 0) -> None:
        """Choice ``choice`` of ``msg`` (``msg.n`` > 1 makes several requests of one prompt)."""
        self.rid = msg.rid + choice
        self.request_id = f"{msg.request_id}-{choice}" if choice else msg.request_id
        # Its own list: outputs are appended (after those a continued request brings).
        self.token_ids: list[int] = [*msg.prompt_token_ids, *msg.output_token_ids]
        self.num_prompt_tokens = len(msg.prompt_token_ids)
        sampling = msg.sampling
        if choice and sampling.seed is not None:
            sampling = msgspec.structs.replace(sampling, seed=(sampling.seed + choice) % 2**63)
        if (choice or msg.output_token_ids) and sampling.prompt_logprobs is not None:
            # The first choice computes them for all; a continued request has reported them.
            sampling = msgspec.structs.replace(sampling, prompt_logprobs=None)
        self.sampling: SamplingParams = sampling
        self.priority = msg.priority
        self.user = msg.user
        self.arrival_time = msg.arrival_time
        self.after = msg.rid if choice else None  # the first choice, whose prompt KV this one waits to share
        self.status = Status.WAITING
        self.num_computed = 0
        self.blocks: list[int] = []
        self.num_preemptions = 0
        self.on_worker = False
        self.worker_blocks = 0  # how many of ``blocks`` the worker's block table already has
        self.block_keys: list[bytes] = []  # prefix-cache keys of its first full blocks, as known so far
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served at first admission
        self.host_blocks: list[int] = []  # swap preemption: where its KV waits in host memory
        self.scheduled_at: float | None = None  # wall time of its first admission
        # ``add_output``'s quick answer, set by its first full check: below ``quiet_until`` tokens
        # only a token in ``may_stop`` can end the request (0: every token gets the full check).
        self.may_stop: frozenset[int] = frozenset()
        self.quiet_until = 0

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_swapped(self) -> bool:
        return bool(self.host_blocks)

    def max_total_tokens(self, max_model_len: int) -> int:
        """The most tokens this request can ever hold (prompt + every output)."""
        return min(self.num_prompt_tokens + self.sampling.max_tokens, max_model_len)

    # ------------------------------------------------------------------ transitions

    def admit(self, blocks: list[int], num_computed: int) -> None:
        """Run on ``blocks``, whose first ``num_computed`` tokens' KV is there already (prefix
        hits, or a swapped-out copy being moved in). At its first admission, those are what the
        prefix cache served."""
        if self.num_preemptions == 0:
            self.num_cached_tokens = num_computed
        if self.scheduled_at is None:
            self.scheduled_at = time.time()
        self.blocks = blocks
        self.num_computed = num_computed
        self.status = Status.RUNNING

    def grow(self, blocks: list[int]) -> None:
        """More blocks for the tokens it is about to compute."""
        self.blocks.extend(blocks)

    def advance(self, n: int) -> None:
        """``n`` more tokens computed (planned, or confirmed by the worker's reply)."""
        self.num_computed += n

    def unsent_blocks(self) -> list[int]:
        """The blocks the worker's table lacks; from now on it has them."""
        have, now = self.worker_blocks, len(self.blocks)
        if have == now:  # most rows of most steps
            return []
        self.worker_blocks = now
        return self.blocks[have:]

    def send_whole(self) -> NewRequest:
        """What the worker (re)builds it from: everything known so far. Not copied: a plan is
        encoded as soon as it is made, before any token is appended."""
        self.on_worker = True
        self.worker_blocks = 0
        return NewRequest(self.rid, self.token_ids, self.num_prompt_tokens, self.sampling, self.num_computed)

    def add_output(self, token: int, eos_token_ids: tuple[int, ...], max_model_len: int) -> str | None:
        """Append a sampled token; the finish reason it triggers, if any: ``protocol.stop``'s
        rule, the worker's too. Called for every row of every step: most tokens are answered by
        the quick test, which the full rule's first run sets up (the same answer, exactly)."""
        tokens = self.token_ids
        tokens.append(token)
        num_tokens = len(tokens)
        if num_tokens < self.quiet_until and token not in self.may_stop:
            return None
        sampling = self.sampling
        if sampling.prompt_logprobs is not None:
            # They came with this first output: a recompute need not compute them again, and may
            # take its prompt from the prefix cache.
            self.sampling = sampling = msgspec.structs.replace(sampling, prompt_logprobs=None)
        # Below both length limits, only a stop token, or an EOS the request does not ignore, stops it.
        self.quiet_until = min(self.num_prompt_tokens + sampling.max_tokens, max_model_len)
        self.may_stop = frozenset(sampling.stop_token_ids).union(() if sampling.ignore_eos else eos_token_ids)
        return stop_reason(token, num_tokens - self.num_prompt_tokens, num_tokens, sampling, eos_token_ids,
                           max_model_len)

    def pause(self) -> None:
        self.status = Status.PAUSED

    def resume(self) -> bool:
        """Back from a pause: True if it runs on at once (its blocks were kept), False if it
        goes back in line."""
        if self.blocks:
            self.status = Status.RUNNING
            return True
        self.requeue()
        return False

    def requeue(self) -> None:
        """In line again, as new or (with outputs, or KV in host memory) preempted."""
        self.status = Status.PREEMPTED if self.num_outputs or self.host_blocks else Status.WAITING

    def drop_kv(self) -> list[int]:
        """Give up every device block (returned, to free) and the worker's state: its tokens
        are computed again when it next runs. Its status is the caller's to set."""
        blocks, self.blocks = self.blocks, []
        self.num_computed = 0
        self.num_preemptions += 1
        self.on_worker = False
        self.worker_blocks = 0
        return blocks

    def preempt(self) -> list[int]:
        """Preempted by recompute: the blocks to free; back in line."""
        blocks = self.drop_kv()
        self.status = Status.PREEMPTED
        return blocks

    def swap_out(self, host_blocks: list[int]) -> list[int]:
        """Preempted by swap: the KV moves to ``host_blocks``; returns the device blocks to free."""
        blocks, self.blocks = self.blocks, []
        self.host_blocks = host_blocks
        self.num_preemptions += 1
        self.on_worker = False
        self.worker_blocks = 0
        self.status = Status.PREEMPTED
        return blocks

    def take_host_blocks(self) -> list[int]:
        """Its KV in host memory (being swapped in, or lost with the worker): the host blocks, to free."""
        blocks, self.host_blocks = self.host_blocks, []
        return blocks

    def set_priority(self, priority: int) -> None:
        self.priority = priority

    def finish(self) -> list[int]:
        """Ended: the device blocks to free (its host blocks must be taken first)."""
        self.status = Status.FINISHED
        blocks, self.blocks = self.blocks, []
        return blocks

    # ------------------------------------------------------------------ prefix cache

    def cached_prefix(self, pool: BlockPool, block_size: int) -> list[int]:
        """The pool's blocks holding the longest cached prefix of these tokens, found by their
        links; their keys are the pool's, so no sha256 is computed here. None for a request
        that wants its prompt's logprobs or its mean: every position must be computed."""
        if self.sampling.every_position:
            return []
        tokens = self.token_ids
        full = len(tokens) // block_size
        found: list[int] = []
        found_keys: list[bytes] = []
        memo = pool.last_walk
        if memo is not None and memo[0] == pool.evictions:  # its hits are all still cached
            n = _common_blocks(tokens, memo[1], block_size, len(memo[2]))
            found, found_keys = memo[2][:n], memo[3][:n]
        first = len(found)
        if first < full:
            # The rest packed at once and sliced per block: a struct call per block was most of an
            # admission step under shared prefixes.
            rest = tokens[first * block_size : full * block_size]
            packed, width, lookup = _packer(len(rest))(*rest), block_size * _INT64_BYTES, pool.lookup
            parent = found_keys[-1] if found_keys else ROOT_KEY
            for offset in range(0, len(packed), width):
                hit = lookup(parent + packed[offset : offset + width])
                if hit is None:
                    break
                block, parent = hit
                found.append(block)
                found_keys.append(parent)
        pool.last_walk = (pool.evictions, tokens[: len(found) * block_size], found, found_keys)
        keys = self.block_keys
        if len(found_keys) > len(keys):
            keys.extend(found_keys[len(keys):])
        return list(found)

    def block_links(self, first: int, last: int, block_size: int) -> list[bytes]:
        """The links of full blocks ``first`` to ``last - 1``. Keys of blocks up to ``last - 1``
        not known yet are computed, so ``block_keys`` then covers at least ``last`` blocks."""
        keys = self.block_keys
        start = min(first, len(keys))
        tokens = self.token_ids[start * block_size : last * block_size]
        packed = _packer(len(tokens))(*tokens)
        width, sha256 = block_size * _INT64_BYTES, hashlib.sha256  # a local: the loop is hot
        links = []
        for i in range(start, last):
            offset = (i - start) * width
            link = (keys[i - 1] if i else ROOT_KEY) + packed[offset : offset + width]
            if i == len(keys):
                keys.append(sha256(link).digest())
            if i >= first:
                links.append(link)
        return links

    def summary(self, block_size: int) -> dict[str, object]:
        return {
            "id": self.request_id,
            "rid": self.rid,
            "state": self.status.value,
            "priority": self.priority,
            "user": self.user,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_outputs,
            "computed_tokens": self.num_computed,
            "kv_blocks": len(self.blocks),
            "preemptions": self.num_preemptions,
            "arrival_time": self.arrival_time,
            "queue_s": (self.scheduled_at or time.time()) - self.arrival_time,
        }
