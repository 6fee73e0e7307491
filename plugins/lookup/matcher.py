"""The n-gram matcher behind prompt lookup, compiled with numba.

One backward-comparison pass over the history finds, for every earlier end position,
how many of the last ``max_ngram`` tokens it repeats; the first end position with the
longest (clipped) match wins, so ties go to the earliest occurrence (or, asked for, the
most recent one: the scan runs backwards). Cost is
O(N * matched length), which is O(N) on ordinary text.
"""

from __future__ import annotations

import numba
import numpy as np


def _jit(fn):
    # cache=True: a fresh process loads the compiled matcher instead of compiling it (~0.3 s of a cold start); numba
    # keeps it beside this file or in the user's cache folder, and refuses to cache only when neither is writable
    try:
        return numba.njit(cache=True)(fn)
    except RuntimeError:  # "no locator available": compile once per process instead
        return numba.njit(cache=False)(fn)


@_jit
def find_continuation(history, length, min_ngram, max_ngram, max_tokens, latest=False):
    """Return (start, count): ``history[start:start+count]`` follows the best earlier match.

    history: [capacity] int64, of which ``history[:length]`` is prompt + output. The
    suffix n-gram (min_ngram <= n <= max_ngram) must occur ending at a position before
    the last token, so a continuation of at least one token exists; ``count`` is capped
    by ``max_tokens`` and by the end of the history. Among the longest matches the
    earliest wins, or with ``latest`` the most recent. No match -> (0, 0).
    """
    best_len = 0
    best_end = -1
    last = length - 1
    if max_tokens <= 0 or length < min_ngram + 1:
        return 0, 0
    for i in range(last):
        end = last - 1 - i if latest else i  # end: last index of an earlier occurrence, in preference order
        n = 0
        while n < max_ngram and n <= end and history[end - n] == history[last - n]:
            n += 1
        if n > best_len:
            best_len = n
            best_end = end
            if n == max_ngram:
                break  # nothing longer counts, and the ends still to come are less preferred
    if best_len < min_ngram:
        return 0, 0
    start = best_end + 1
    return start, min(max_tokens, length - start)


def warm_up() -> None:
    """Compile for the int64 signature used at run time, so the first cycle pays no JIT cost."""
    for latest in (False, True):
        find_continuation(np.zeros(8, dtype=np.int64), np.int64(4), np.int64(2), np.int64(3), np.int64(2), latest)
