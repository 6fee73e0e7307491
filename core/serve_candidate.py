"""One choice of a served request as it runs in a request slot: its cycles turned into text deltas.

A request for ``n`` choices (or ``best_of`` candidates) is that many ``Candidate`` objects, each
an executor request of its own (candidate i of a seeded request is seeded ``seed + i``), so
they run side by side in the batch where slots allow. After every cycle the worker hands the
candidate its ``CycleResult``; the candidate decodes the committed tokens, holds back what a
stop string may still claim (``StopScanner``), pairs the released text with the logprobs of
its tokens (core/openai_logprobs.py), and either puts the delta on the request's event queue
(``live``: the choices are streamed as they are generated) or keeps it (``best_of``: sent once
the best candidates are known).
"""

from __future__ import annotations

import attrs

from draftflow.core.node import MAX_SEED, SamplingParams
from draftflow.core.openai_logprobs import TokenTexts
from draftflow.core.stop_strings import StopScanner


@attrs.define(eq=False)
class Candidate:
    """One generated choice of ``req`` (a ``ServeRequest``): ``index`` in its request, the executor state once
    started, and what it has produced so far."""

    req: object  # the ServeRequest
    index: int
    scanner: StopScanner
    texts: TokenTexts | None = None  # logprob pieces, when the request asks for logprobs (or ranks best_of)
    state: object = None  # the executor's ActiveRequest, once started
    result: object = None  # the executor's Result, once finished
    finish: str = ""
    deltas: list = attrs.field(factory=list)  # events kept for later (best_of)
    kept: list = attrs.field(factory=list)  # TokenText of the tokens whose text was released
    pending: list = attrs.field(factory=list)  # TokenText of tokens whose text is not released yet
    logprob: float = 0.0  # total logprob of ``kept`` (best_of ranks by it)

    @classmethod
    def of(cls, req, index: int, decode) -> "Candidate":
        texts = TokenTexts(decode, req.prompt_ids) if req.sampling.logprobs is not None else None
        return cls(req, index, StopScanner(decode, req.stop), texts)

    @property
    def request_id(self) -> str:
        """The trace's request_id: the request's id for choice 0, ``<id>-<i>`` for the others."""
        return self.req.id if self.index == 0 else f"{self.req.id}-{self.index}"

    @property
    def sampling(self) -> SamplingParams:
        sampling = self.req.sampling
        if sampling.seed is not None and self.index:  # candidate i of a seeded request: seed + i
            sampling = attrs.evolve(sampling, seed=(sampling.seed + self.index) % (MAX_SEED + 1))
        return sampling

    @property
    def live(self) -> bool:
        """Choices go out as they are generated unless best_of must first pick the best."""
        return self.req.best_of == self.req.n

    def feed(self, cycle) -> bool:
        """Take one cycle's committed tokens; send (or keep) the text they release. True when a stop string ended
        the text (every committed token still counts)."""
        if self.texts is not None:
            self.pending += [self.texts.add(lp.token, lp.logprob, lp.top) for lp in cycle.logprobs or ()]
        delta, hit = self.scanner.feed(cycle.emitted)
        self._send(delta, self.scanner.sent)
        return hit

    def flush(self) -> None:
        """The request ended without a stop string: send whatever text was held back."""
        self._send(self.scanner.flush(), None)

    def done(self, result) -> None:
        """The executor's ``Result`` of this candidate (its slot is free again)."""
        self.result, self.finish = result, result.finish_reason
        self.logprob = sum(p.logprob for p in self.kept)

    def _send(self, text: str, upto: int | None) -> None:
        pieces = None
        if self.texts is not None:  # the tokens whose text starts in what was sent so far
            keep = len(self.pending) if upto is None else sum(p.offset < upto for p in self.pending)
            pieces, self.pending = self.pending[:keep], self.pending[keep:]
            self.kept.extend(pieces)
        if text or pieces:
            event = ("delta", self.index, text, pieces if self.req.logprobs else None)
            self.req.events.put(event) if self.live else self.deltas.append(event)

