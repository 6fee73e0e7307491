"""The numba n-gram matcher and the node's history bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest

from draftflow.plugins.lookup.matcher import find_continuation


def match(seq, min_n=2, max_n=5, k=4, latest=False):
    arr = np.zeros(len(seq) + 8, dtype=np.int64)  # spare capacity past the length, as at run time
    arr[:len(seq)] = seq
    start, count = find_continuation(arr, len(seq), min_n, max_n, k, latest)
    return list(arr[start:start + count])


def test_longest_ngram_wins_over_earlier_shorter_match():
    """A 3-gram match later in the sequence beats an earlier 2-gram match."""
    #        [2, 3] at 1 (then 9); [1, 2, 3] at 5 (then 7)
    assert match([5, 2, 3, 9, 0, 1, 2, 3, 7, 8, 1, 2, 3]) == [7, 8, 1, 2]


def test_earliest_occurrence_on_ties():
    """Among equally long matches the earliest occurrence is copied."""
    assert match([4, 1, 2, 10, 11, 3, 1, 2, 20, 21, 1, 2]) == [10, 11, 3, 1]


def test_latest_occurrence_when_asked():
    """occurrence: latest copies the most recent of equally long matches, and a longer match still wins."""
    assert match([4, 1, 2, 10, 11, 3, 1, 2, 20, 21, 1, 2], latest=True) == [20, 21, 1, 2]
    assert match([5, 2, 3, 9, 0, 1, 2, 3, 7, 8, 1, 2, 3], latest=True) == [7, 8, 1, 2]


def test_k_caps_the_proposal_and_context_end_cuts_it():
    """At most K tokens are proposed, and never past the end of the sequence."""
    seq = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert match(seq, k=3) == [3, 4, 5]
    assert match([1, 2, 9, 1, 2], k=8) == [9, 1, 2]


def test_no_match_or_too_short_gives_no_drafts():
    """No repeated n-gram of at least min_ngram, or K = 0, proposes nothing."""
    assert match([1, 2, 3, 4, 5]) == []
    assert match([1, 2, 3, 9, 2, 3], min_n=3) == []
    assert match([1, 2, 9, 1, 2], k=0) == []
    assert match([7]) == []


def test_max_ngram_clips_match_length():
    """Matches longer than max_ngram count as max_ngram, so the earliest such occurrence wins."""
    seq = [9, 1, 2, 3, 50, 8, 1, 2, 3, 60, 8, 1, 2, 3]
    assert match(seq, max_n=3) == [50, 8, 1, 2]
    assert match(seq, max_n=4) == [60, 8, 1, 2]


@pytest.mark.parametrize("seed", range(3))
def test_matches_a_brute_force_reference(seed):
    """On random small-alphabet sequences the result equals a direct longest-then-earliest search."""
    rng = np.random.default_rng(seed)
    for _ in range(200):
        seq = list(rng.integers(0, 3, size=rng.integers(1, 30)))
        want = []
        for n in range(5, 1, -1):
            if len(seq) < n + 1:
                continue
            hits = [s for s in range(len(seq) - n) if seq[s:s + n] == seq[-n:]]
            if hits:
                want = seq[hits[0] + n:hits[0] + n + 4]
                break
        assert match(seq) == want, seq
def test_the_compiled_matcher_is_cached_on_disk():
    """A fresh process loads the matcher numba compiled before (~0.3 s of a cold start) instead of compiling it."""
    from numba.core.caching import NullCache

    from draftflow.plugins.lookup.matcher import find_continuation

    assert not isinstance(find_continuation._cache, NullCache)
