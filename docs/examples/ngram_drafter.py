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

import torch

from draftflow.plugin import TARGET_HANDLE, Manifest, Node, NodeType, ParamSpec, Port, Proposal, Vram, hookimpl

PARAMS = (ParamSpec("order", "int", 2, "tokens of context a continuation is keyed on", minimum=1),)


def manifest(params, env) -> Manifest:
    """Declared before anything loads: one proposal output, the target interface, device bytes."""
    return Manifest(
        role="drafter",
        outputs=(Port("proposal", "proposal", doc="up to K tokens [1, K], probs None"),),
        requires={TARGET_HANDLE},  # so ctx.target is the loaded target's TargetHandle
        vram=Vram(scratch=8 * env.num_draft),  # the int64 draft row; the table lives in host memory
    )


class NgramDrafter(Node):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.order = ctx.params["order"]
        self.stop = set(ctx.target.eos_ids)  # drafting past the end would be wasted work
        self.table: dict[tuple[int, ...], int] = {}
        self.learned = 0  # how many of req.tokens the table has seen

    def learn(self, tokens: list[int]) -> None:
        # The latest continuation of an n-gram wins: it follows a text whose pattern just changed.
        for i in range(max(self.learned, self.order), len(tokens)):
            self.table[tuple(tokens[i - self.order:i])] = tokens[i]
        self.learned = len(tokens)

    def prefill(self, req):
        self.table, self.learned = {}, 0  # a new request: another text's n-grams would only mislead
        self.learn(req.tokens)
        return {}

    def step(self, req, inputs):
        context, drafts = list(req.tokens[-self.order:]), []
        while len(drafts) < req.num_draft:
            nxt = self.table.get(tuple(context[-self.order:]))
            if nxt is None:
                break
            drafts.append(nxt)
            context.append(nxt)
            if nxt in self.stop:
                break
        tokens = torch.tensor(drafts, dtype=torch.long, device=self.ctx.device).reshape(1, len(drafts))  # [B=1, K]
        return {"proposal": Proposal(tokens)}

    def commit(self, req, info):
        self.learn(req.tokens)  # committed tokens only grow (a rejection never removes them): learn the tail
        return {}


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="ngram", role="drafter", manifest=manifest, factory=NgramDrafter, params=PARAMS,
        description="drafts the continuation last seen after the current n-gram (example plugin)"))
