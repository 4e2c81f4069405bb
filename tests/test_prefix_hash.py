"""Prefix-cache keys: a collision-resistant digest chained over the parent block's key.

They used to be Python's ``hash((parent, tuple(tokens)))``: 64 bits, and a function of each token
id's ``hash()``, so different token blocks could be made to share a key and one tenant's prompt
could be served another's cached KV (the class of vLLM's CVE-2025-25183)."""

from __future__ import annotations

import hashlib
import sys

from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_scheduler_core import make, run_to_end
from test_scheduler_policies import add_tokens

from protocol.messages import AddRequest, SamplingParams
from scheduler.block_pool import BlockPool
from scheduler.request import Request

BS = 16


def request(tokens: list[int]) -> Request:
    return Request(AddRequest(0, "r", tokens, SamplingParams(), 0, "", 0.0))


def keys(tokens: list[int]) -> list[bytes]:
    req = request(tokens)
    req.block_links(0, len(tokens) // BS, BS)
    return req.block_keys


def documented_link(parent: bytes, block: list[int]) -> bytes:
    """The parent block's key, then the block's token ids as little-endian int64s; written out
    here independently of the scheduler's packing."""
    return parent + b"".join(t.to_bytes(8, "little", signed=True) for t in block)


def tokens_of(n: int, start: int) -> list[int]:
    return [(start + 7 * j) % 30000 + 3 for j in range(n)]


def test_a_block_key_is_the_sha256_of_its_parent_key_and_its_tokens() -> None:
    tokens = tokens_of(3 * BS + 5, start=1)  # three full blocks and a partial one, which has no key
    links, expected, parent = [], [], b""  # the first block's parent key is empty
    for i in range(3):
        links.append(documented_link(parent, tokens[i * BS : (i + 1) * BS]))
        parent = hashlib.sha256(links[-1]).digest()
        expected.append(parent)
    req = request(tokens)
    assert req.block_links(0, 3, BS) == links
    assert req.block_keys == expected
    assert req.block_links(1, 3, BS) == links[1:] and req.block_keys == expected  # computed once


def test_keys_grow_with_the_tokens_as_if_computed_at_once() -> None:
    tokens = tokens_of(4 * BS, start=2)
    req = request(tokens[: BS + 3])
    req.block_links(0, 1, BS)
    for t in tokens[BS + 3 :]:
        req.add_output(t, (), 10**6)
        req.block_links(len(req.block_keys), len(req.token_ids) // BS, BS)
    assert req.block_keys == keys(tokens)


def test_equal_prefixes_give_equal_keys_and_a_block_after_another_parent_another_key() -> None:
    shared, block = tokens_of(2 * BS, start=3), tokens_of(BS, start=900)
    a = keys(shared + block + tokens_of(BS, start=4))
    b = keys(shared + block + tokens_of(BS, start=5))
    assert a[:3] == b[:3] and a[3] != b[3]
    # The same tokens after a different first block: every later key differs.
    c = keys(tokens_of(BS, start=6) + shared[BS:] + block)
    assert c[0] != a[0] and c[1] != a[1] and c[2] != a[2]


def test_a_prefix_hit_is_found_by_link_and_takes_its_key_from_the_pool() -> None:
    pool = BlockPool(8, enable_caching=True)
    a = tokens_of(3 * BS, start=10)
    cached = request(a)
    for i, link in enumerate(cached.block_links(0, 3, BS)):
        pool.register(i, link, cached.block_keys[i])
    # Shares a's first two blocks: they are found, and their keys learnt without hashing.
    b = request(a[: 2 * BS] + tokens_of(BS, start=11))
    assert b.cached_prefix(pool, BS) == [0, 1]
    assert b.block_keys == cached.block_keys[:2]
    # a's second block's tokens first: another parent, so no hit.
    assert request(a[BS : 2 * BS]).cached_prefix(pool, BS) == []


def old_key(parent: int | None, block: list[int]) -> int:
    """The scheme this replaced."""
    return hash((parent, tuple(block)))


def colliding_blocks() -> tuple[list[int], list[int]]:
    """Two different token blocks with the same old key: ``hash()`` of an int is reduced modulo
    ``sys.hash_info.modulus``, so ids that differ by it hash alike, and a tuple's hash sees only
    its items' hashes. (Such ids are outside any vocabulary and the frontend rejects them; an
    in-vocabulary collision of the 64-bit old key takes a birthday search of about 2**32 blocks,
    too slow for a test. This shows that the key itself was not collision resistant.)"""
    block = tokens_of(BS, start=8)
    return block, [block[0] + sys.hash_info.modulus, *block[1:]]


def test_blocks_whose_old_keys_collide_get_different_keys() -> None:
    a, b = colliding_blocks()
    assert a != b and old_key(None, a) == old_key(None, b)
    assert keys(a) != keys(b)


def test_a_prompt_is_not_served_the_kv_of_a_prompt_whose_old_keys_collide() -> None:
    # Under the old keys the second prompt was served the first one's first block: the fake
    # worker, which checks every position's KV by content, found the other token's KV there.
    a, b = colliding_blocks()
    sched, worker = make(num_blocks=64, enable_prefix_caching=True)
    add_tokens(sched, 0, a + tokens_of(BS, start=9), max_tokens=2)
    assert run_to_end(sched, worker) == {0: "length"}
    add_tokens(sched, 1, b + tokens_of(BS, start=9), max_tokens=2)
    assert run_to_end(sched, worker) == {1: "length"}
    assert sched.pool.hits == 0


def _walk_without_memo(req: Request, pool: BlockPool) -> list[int]:
    """The longest cached prefix found block by block from the root, as the walk was before it
    kept a memo of the last one."""
    found, parent, tokens = [], b"", req.token_ids
    for start in range(0, len(tokens) - BS + 1, BS):
        hit = pool.lookup(parent + b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[start : start + BS]))
        if hit is None:
            break
        found.append(hit[0])
        parent = hit[1]
    return found


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 6), st.integers(0, 2), st.integers(0, 2)),
                min_size=1, max_size=40))
# Walked, not admitted, its tail block evicted by another's allocation, walked again.
@example([(0, 4, 0, 1), (0, 4, 0, 2), (0, 4, 0, 1)])
def test_the_walk_remembered_from_the_last_prompt_finds_what_a_fresh_walk_finds(
        ops: list[tuple[int, int, int, int]]) -> None:
    """Prompts from a few shared prefixes, walked in turn, while blocks are registered, taken,
    freed and evicted (a small pool, so allocation evicts cached blocks): every walk, which may
    start from the previous prompt's hits, finds exactly the blocks a walk from the root finds.
    A request may be walked and not admitted (no room), and other requests' blocks then evict
    what it found: a memo kept past an eviction would hand out a block now holding other tokens."""
    pool = BlockPool(6, enable_caching=True)
    held: list[list[int]] = []

    def make_room(n: int) -> None:
        if not pool.can_allocate(n):  # (taking a free cached hit takes it off the free list too)
            for blocks in held:
                pool.free(blocks)
            held.clear()

    for prefix, length, tail, action in ops:
        tokens = tokens_of(2 * BS, start=prefix)[: length * BS // 2] + tokens_of(BS, start=100 + tail)
        req = request(tokens)
        hit = req.cached_prefix(pool, BS)
        assert hit == _walk_without_memo(req, pool)
        assert req.block_keys[: len(hit)] == keys(tokens)[: len(hit)]
        if action == 2:  # not admitted; another request's new blocks take the pool's free ones
            make_room(4)
            held.append(pool.allocate(4))
            continue
        full = len(tokens) // BS
        make_room(full)
        pool.take(hit)
        blocks = hit + pool.allocate(full - len(hit))
        for i, link in enumerate(req.block_links(len(hit), full, BS), len(hit)):
            pool.register(blocks[i], link, req.block_keys[i])
        if action == 0:
            held.append(blocks)
        else:
            pool.free(blocks)
