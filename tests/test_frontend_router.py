"""The data-parallel router alone: requests spread by load, prompts sharing a prefix stay on the
engine that has it (unless it is much busier), engines out of rotation get nothing and forget
what they had."""

from __future__ import annotations

from frontend.router import PREFIX_BLOCK, SLACK_ABS, Router, prefix_hashes


def _prompt(seed: int, n: int = 100) -> list[int]:
    return [1, *((seed * 31 + 7 * j) % 250 + 3 for j in range(n - 1))]


def test_distinct_prompts_take_turns_over_equally_loaded_engines() -> None:
    router = Router(3)
    assert [router.choose(_prompt(i), [0, 0, 0]) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert router.load_routed == 6 and router.affinity_routed == 0


def test_the_least_loaded_engine_wins() -> None:
    router = Router(3)
    assert router.choose(_prompt(1), [5, 2, 9]) == 1


def test_a_shared_prefix_stays_on_its_engine_until_that_engine_is_much_busier() -> None:
    router = Router(2)
    system = _prompt(0, 96)
    first = router.choose([*system, 5, 6], [0, 0])
    assert first is not None
    other = 1 - first
    loads: list[float | None] = [0.0, 0.0]
    loads[first] = SLACK_ABS  # busier, but within the slack: still where its prefix is cached
    assert router.choose([*system, 7, 8, 9], loads) == first
    assert router.affinity_routed == 1
    loads[first] = SLACK_ABS + 1.0
    assert router.choose([*system, 10], loads) == other  # too busy: the prefix goes elsewhere


def test_a_prompt_that_shares_only_a_little_is_routed_by_load() -> None:
    router = Router(2)
    head = _prompt(0, PREFIX_BLOCK + 1)
    first = router.choose(head + _prompt(1, 200), [0, 0])
    # One block of 13 in common: not worth a busier engine.
    assert router.choose(head + _prompt(2, 200), [1.0 if i == first else 0.0 for i in range(2)]) != first


def test_an_engine_out_of_rotation_gets_nothing_and_forgets_its_prefixes() -> None:
    router = Router(2)
    prompt = _prompt(3)
    assert router.choose(prompt, [0, 0]) == 0
    assert router.choose(prompt, [None, 0]) == 1
    assert not router.seen[0]
    assert router.choose(prompt, [0, 0]) == 1  # back in rotation, but its prefix is on engine 1 now
    assert router.choose(_prompt(4), [None, None]) is None


def test_prefix_hashes_cover_whole_blocks_before_the_last_token() -> None:
    assert prefix_hashes(list(range(PREFIX_BLOCK))) == []
    hashes = prefix_hashes(list(range(2 * PREFIX_BLOCK + 1)))
    assert len(hashes) == 2 and prefix_hashes(list(range(PREFIX_BLOCK + 1))) == hashes[:1]
