"""The n-gram proposer (speculative decoding's prompt lookup): what it proposes, against a plain
scan of the tokens, as a sequence grows token by token."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.ngram import NgramConfig, NgramIndex


def scanned(tokens: list[int], limit: int, n_min: int, n_max: int) -> list[int]:
    """The definition, by brute force: the longest suffix (n_max down to n_min tokens) that
    occurred earlier, at its latest earlier occurrence; the tokens after that occurrence."""
    end = len(tokens)
    for n in range(min(n_max, end - 1), n_min - 1, -1):
        suffix = tokens[end - n :]
        for i in range(end - n - 1, -1, -1):  # an occurrence ending before the last token
            if tokens[i : i + n] == suffix:
                return tokens[i + n : min(i + n + limit, end)]
    return []


def test_the_continuation_of_the_latest_earlier_occurrence() -> None:
    index = NgramIndex(NgramConfig(num_tokens=3, n_min=2, n_max=3))
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # The suffix [1, 2, 3] occurred at the start: what followed it there.
    assert index.propose(tokens, 10) == [4, 5, 9]
    assert index.propose(tokens, 2) == [4, 5]
    tokens += [6, 2, 3]  # now only [2, 3] matches, latest at positions 11-12: [6, 2, 3] followed it
    assert index.propose(tokens, 10) == [6, 2, 3]
    tokens += [7]  # [2, 3, 7] occurred at 6-8: the three-token match wins over [3, 7]'s
    assert index.propose(tokens, 10) == [8, 1, 2]


def test_nothing_when_no_suffix_occurred_before() -> None:
    index = NgramIndex(NgramConfig(num_tokens=4, n_min=2, n_max=4))
    assert index.propose([5, 6, 7, 8], 4) == []
    assert index.propose([5], 4) == []
    assert index.propose([], 4) == []
    assert index.propose([5, 6, 5, 6], 0) == []  # no room


def test_a_proposal_stops_at_the_end_of_what_is_known() -> None:
    index = NgramIndex(NgramConfig(num_tokens=8, n_min=1, n_max=2))
    # [4, 4] occurred ending at position 1: what follows is [4], then the sequence ends.
    assert index.propose([4, 4, 4], 8) == [4]


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=60), n_min=st.integers(1, 3), extra=st.integers(0, 2),
       num_tokens=st.integers(1, 5), limits=st.lists(st.integers(0, 6), min_size=1, max_size=60))
def test_growing_token_by_token_proposes_what_a_scan_finds(tokens: list[int], n_min: int, extra: int,
                                                           num_tokens: int, limits: list[int]) -> None:
    """Small alphabets make many repeats: every prefix's proposal, asked of one index as the
    sequence grows (sometimes several tokens between two asks), is the brute-force scan's."""
    n_max = n_min + extra
    index = NgramIndex(NgramConfig(num_tokens, n_min, n_max))
    for end in range(len(tokens) + 1):
        limit = limits[end % len(limits)]
        if limit == 6:
            continue  # skip asking here: the index catches up over several new tokens next time
        got = index.propose(tokens[:end], limit)
        assert got == scanned(tokens[:end], min(limit, num_tokens), n_min, n_max), (tokens[:end], limit)
