"""The ``bigram`` drafter: follows the most frequent successor of each token.

It learns, online and per request, how often each token followed each other token in
the prompt and the committed output, then drafts by walking the chain of most frequent
successors from the anchor. Where the current token has no successor seen at least
``min_count`` times it stops, so a cycle may carry fewer drafts than asked for, or none.
Repetitive text (code, lists, templates) is where this pays off.

The drafts are deterministic, so the proposal carries no probabilities: the verifier
treats q as one-hot and stays lossless at any temperature.
"""

from __future__ import annotations

from typing import Sequence

from draftflow.plugin import Manifest, Node, NodeType, ParamSpec, Port, Proposal, SpecError, Vram, hookimpl

PARAMS = (
    ParamSpec("min_count", "int", 1, "times a successor must have been seen before it is drafted (>= 1)"),
)


class BigramTable:
    """Counts of next token given previous token, with the current best successor kept up to date."""

    def __init__(self, min_count: int = 1):
        self.min_count = min_count
        self.counts: dict[int, dict[int, int]] = {}
        # prev -> most frequent successor; a tie goes to the successor seen most recently,
        # which tracks a text whose pattern has just changed.
        self.best: dict[int, int] = {}

    def observe(self, tokens: Sequence[int], start: int = 0) -> None:
        """Count the pairs ``(tokens[i-1], tokens[i])`` for ``i >= start`` (pairs before it are already counted)."""
        for i in range(max(start, 1), len(tokens)):
            prev, tok = tokens[i - 1], tokens[i]
            followers = self.counts.setdefault(prev, {})
            count = followers[tok] = followers.get(tok, 0) + 1
            if count >= followers.get(self.best.get(prev), 0):
                self.best[prev] = tok

    def successor(self, token: int) -> int | None:
        """The most frequent successor of ``token`` if seen at least ``min_count`` times, else None."""
        tok = self.best.get(token)
        if tok is None or self.counts[token][tok] < self.min_count:
            return None
        return tok

    def chain(self, token: int, max_len: int) -> list[int]:
        """Up to ``max_len`` tokens following ``token`` greedily; shorter where the chain runs out."""
        out: list[int] = []
        while len(out) < max_len:
            nxt = self.successor(token)
            if nxt is None:
                break
            out.append(nxt)
            token = nxt
        return out


def manifest(params, env) -> Manifest:
    if params["min_count"] < 1:
        raise SpecError(f"bigram: min_count is {params['min_count']}; set params.min_count to 1 or more")
    return Manifest(
        role="drafter",
        outputs=(Port("proposal", "proposal", doc="greedy bigram chain from the anchor, K <= num_draft"),),
        # The counts live in host memory; on the device there are only the [B, K] int64 drafts.
        vram=Vram(scratch=8 * env.num_draft),
    )


class BigramDrafter(Node):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.tables: dict[int, BigramTable] = {}  # request slot -> the counts of the request in it
        self.learned: dict[int, int] = {}  # request slot -> how many of its req.tokens the table has counted

    def prefill(self, req):
        # A new request starts from nothing: counts from another text would only mislead.
        self.tables[req.slot] = BigramTable(self.ctx.params["min_count"])
        self.tables[req.slot].observe(req.tokens)
        self.learned[req.slot] = len(req.tokens)
        return {}

    def step(self, batch, inputs):
        # Row i is the request in slot i, or None for a slot this cycle does not step (its row is ignored).
        rows = [self.tables[req.slot].chain(req.anchor, req.num_draft) if req is not None else [] for req in batch.rows]
        return {"proposal": Proposal.from_rows(rows, self.ctx.device)}

    def commit(self, req, info):
        # Committed tokens only ever grow, so learning the new tail is all a commit needs.
        self.tables[req.slot].observe(req.tokens, start=self.learned[req.slot])
        self.learned[req.slot] = len(req.tokens)
        return {}

    def release(self, req):
        del self.tables[req.slot], self.learned[req.slot]


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="bigram", role="drafter", manifest=manifest, factory=BigramDrafter, params=PARAMS,
        description="drafts the most frequent successor chain learned from the prompt and output"))
