"""Logprobs as the OpenAI API shows them: each output token's text, offset and alternatives.

The engine gives token ids and logprobs (``TokenLogprob``); ``TokenTexts`` turns them into
``TokenText`` pieces whose texts concatenate to the decoded output (a character split over
several byte-level tokens is given whole on the token that completes it; the pieces before
it have the text ""), and ``choice_logprobs`` formats a choice's pieces for completions
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) or chat (``content``).
Field-by-field reference: docs/SERVING.md.
"""

from __future__ import annotations

import attrs

CONTEXT_TOKENS = 8  # tokens decoded before each one: enough for byte-level merges and SentencePiece spaces
FLOOR = -9999.0  # what OpenAI shows for a logprob of -inf (JSON has no infinity)


@attrs.frozen
class TokenText:
    """One output token as shown: ``text`` (the pieces concatenate to the output), its logprob, its
    alternatives ``top`` ((text, logprob) pairs, most likely first) and its character offset in the output."""

    text: str
    logprob: float
    top: tuple[tuple[str, float], ...]
    offset: int


def _stable(text: str) -> str:
    return text.rstrip("\ufffd")  # an unfinished UTF-8 character decodes as U+FFFD until its last byte arrives


class TokenTexts:
    """Decodes output tokens one at a time, each after the ``CONTEXT_TOKENS`` before it (prompt included)."""

    def __init__(self, decode, prompt_ids):
        self.decode = decode
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.offset = 0  # characters of output text so far

    def add(self, token: int, logprob: float, top=()) -> TokenText:
        """The piece of one output token; ``top``: its (token id, logprob) alternatives."""
        window = self.ids[-CONTEXT_TOKENS:]
        before = _stable(self.decode(window))
        text = self._piece(window, before, token)
        alternatives = tuple((self._piece(window, before, t) or self.decode([t]), lp) for t, lp in top)
        piece = TokenText(text, logprob, alternatives, self.offset)
        self.ids.append(token)
        self.offset += len(text)
        return piece

    def _piece(self, window: list[int], before: str, token: int) -> str:
        after = _stable(self.decode(window + [token]))
        return after[len(before):] if after.startswith(before) else self.decode([token])


def _floor(logprob: float) -> float:
    return max(float(logprob), FLOOR)


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _floor(logprob), "bytes": list(text.encode("utf-8"))}


def choice_logprobs(kind: str, pieces: list[TokenText] | None) -> dict | None:
    """The ``logprobs`` object of one choice (or one streamed chunk) of a completion or chat response."""
    if pieces is None:
        return None
    if kind == "chat":
        return {"content": [{**_entry(p.text, p.logprob), "top_logprobs": [_entry(t, lp) for t, lp in p.top]}
                            for p in pieces], "refusal": None}
    tops = []
    for p in pieces:  # as OpenAI: the alternatives, plus the chosen token when it is not among them
        top = {}
        for text, lp in p.top:
            top.setdefault(text, _floor(lp))
        top.setdefault(p.text, _floor(p.logprob))
        tops.append(top)
    return {"tokens": [p.text for p in pieces], "token_logprobs": [_floor(p.logprob) for p in pieces],
            "top_logprobs": tops, "text_offset": [p.offset for p in pieces]}
