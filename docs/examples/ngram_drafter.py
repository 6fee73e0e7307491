"""``ngram``: a complete third-party drafter in one file, using only ``draftflow.plugin``.

Per request it remembers which token followed each n-gram (``order`` tokens) of the prompt
and of the text generated so far, and drafts by following those continuations from the
last ``order`` tokens. It stops where no continuation is known, after an end-of-sequence
token of the target (read from the target interface), or after K tokens. The drafts are
deterministic, so the proposal carries no probabilities: the verifier treats q as one-hot
and the output is exactly the target's, at any temperature.

Try it without installing anything (a graph with ``d: {plugin: ngram}``):
    PYTHONPATH=docs/examples DRAFTFLOW_PLUGINS=ngram_drafter draftflow generate --graph g.yaml "..."
or publish it under the ``draftflow`` entry-point group of your package:
    [project.entry-points.draftflow]
    ngram = "ngram_drafter"
"""

from __future__ import annotations

from draftflow.plugin import TARGET_HANDLE, Manifest, Node, NodeType, ParamSpec, Port, Proposal, Vram, hookimpl

PARAMS = (ParamSpec("order", "int", 2, "tokens of context a continuation is keyed on", minimum=1),)


def manifest(params, env) -> Manifest:
    """Declared before anything loads: one proposal output, the target interface, device bytes."""
    return Manifest(
        role="drafter",
        outputs=(Port("proposal", "proposal", doc="up to K tokens per row [B, K] with lengths, probs None"),),
        requires={TARGET_HANDLE},  # so ctx.target is the loaded target's TargetHandle
        vram=Vram(scratch=8 * env.num_draft),  # an int64 draft row; the tables live in host memory
    )


class NgramDrafter(Node):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.order = ctx.params["order"]
        self.stop = set(ctx.target.eos_ids)  # drafting past the end would be wasted work
        self.tables: dict[int, dict[tuple[int, ...], int]] = {}  # request slot -> n-gram -> next token
        self.learned: dict[int, int] = {}  # request slot -> how many of its req.tokens the table has seen

    def learn(self, req) -> None:
        # The latest continuation of an n-gram wins: it follows a text whose pattern just changed.
        table, tokens = self.tables[req.slot], req.tokens
        for i in range(max(self.learned[req.slot], self.order), len(tokens)):
            table[tuple(tokens[i - self.order:i])] = tokens[i]
        self.learned[req.slot] = len(tokens)

    def prefill(self, req):
        self.tables[req.slot], self.learned[req.slot] = {}, 0  # a new request: another text's n-grams would only mislead
        self.learn(req)
        return {}

    def draft(self, req) -> list[int]:
        table, context, drafts = self.tables[req.slot], list(req.tokens[-self.order:]), []
        while len(drafts) < req.num_draft:
            nxt = table.get(tuple(context[-self.order:]))
            if nxt is None:
                break
            drafts.append(nxt)
            context.append(nxt)
            if nxt in self.stop:
                break
        return drafts

    def step(self, batch, inputs):
        # Row i is the request in slot i, or None for a slot this cycle does not step (its row is ignored).
        rows = [self.draft(req) if req is not None else [] for req in batch.rows]
        return {"proposal": Proposal.from_rows(rows, self.ctx.device)}

    def commit(self, req, info):
        self.learn(req)  # committed tokens only grow (a rejection never removes them): learn the tail
        return {}

    def release(self, req):
        del self.tables[req.slot], self.learned[req.slot]  # the request left: its slot's table goes with it


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="ngram", role="drafter", manifest=manifest, factory=NgramDrafter, params=PARAMS,
        description="drafts the continuation last seen after the current n-gram (example plugin)"))
