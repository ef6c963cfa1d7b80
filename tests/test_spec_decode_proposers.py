"""The n-gram (prompt lookup) proposer against a brute-force reading of its rule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.workers.spec_decode.ngram_proposer import NgramProposer


def reference(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """The longest suffix (high down to low) found earlier, its latest occurrence, and what
    followed it, read on into the proposal itself."""
    n_tokens = len(tokens)
    for n in range(min(high, n_tokens - 1), low - 1, -1):
        suffix = tokens[n_tokens - n:]
        for start in range(n_tokens - n - 1, -1, -1):   # latest first; never the suffix itself
            if tokens[start:start + n] == suffix:
                extended = list(tokens)
                proposal = []
                for j in range(k):
                    extended.append(extended[start + n + j])
                    proposal.append(extended[-1])
                return proposal
    return []


def test_proposes_what_followed_the_longest_suffix():
    proposer = NgramProposer(3, 1, 3)
    # "7 8 9" ends the sequence and occurred at the start, followed by 1 2 3.
    assert proposer.propose([7, 8, 9, 1, 2, 3, 4, 5, 8, 9, 6, 7, 8, 9]) == [1, 2, 3]
    # Only "9" recurs (last at index 4): what followed it there.
    assert proposer.propose([1, 9, 2, 3, 9, 5, 6, 9]) == [5, 6, 9]


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    proposer = NgramProposer(2, 1, 3)
    tokens = [1, 2, 3, 40, 41, 9, 3, 50, 51, 1, 2, 3]
    assert proposer.propose(tokens) == [40, 41]       # "1 2 3", not the later "3"
    assert NgramProposer(2, 1, 1).propose(tokens) == [50, 51]


def test_a_loop_shorter_than_k_is_proposed_k_deep():
    assert NgramProposer(5, 2, 2).propose([4, 1, 2, 1, 2]) == [1, 2, 1, 2, 1]


def test_nothing_to_propose():
    proposer = NgramProposer(4, 2, 3)
    assert proposer.propose([1, 2, 3, 4, 5]) == []    # no suffix recurs
    assert proposer.propose([1, 1]) == []             # too short for a 2-gram found earlier
    assert proposer.propose([1, 2, 1, 2], max_num_tokens=0) == []
    assert proposer.propose([1, 2, 1, 2], max_num_tokens=1) == [1]


def test_bounds_are_checked():
    with pytest.raises(ValueError):
        NgramProposer(2, 3, 2)
    with pytest.raises(ValueError):
        NgramProposer(2, 0, 2)


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40), k=st.integers(1, 6),
       low=st.integers(1, 4), extra=st.integers(0, 3), cap=st.integers(0, 7))
def test_matches_the_brute_force_rule(tokens, k, low, extra, cap):
    proposer = NgramProposer(k, low, low + extra)
    assert proposer.propose(tokens, 0, cap) == reference(tokens, min(k, cap), low, low + extra)
