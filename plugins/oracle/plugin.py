"""The oracle drafter, for testing: proposes a known continuation, with errors where asked.

Given the reference continuation of the prompt (usually target-only greedy output), it
proposes ``reference[g : g+K]`` where ``g`` tokens have been generated so far, replacing
the token by a wrong one at chosen output positions (``errors``) or at chosen draft
indices of every cycle (``wrong_draft_index``; ``[0]`` makes the first candidate always
wrong). Past the end of the reference it proposes nothing. Every row of a batch gets the
same reference, offset by that request's own output length.
"""

from __future__ import annotations

from draftflow.plugin import Manifest, Node, NodeType, ParamSpec, Port, Proposal, hookimpl

PARAMS = (
    ParamSpec("reference", "int_list", help="token ids that continue the prompt", minimum=0),
    ParamSpec("errors", "int_list", [], "output positions (0-based) whose proposal is wrong", minimum=0),
    ParamSpec("wrong_draft_index", "int_list", [], "draft indices made wrong in every cycle", minimum=0),
    ParamSpec("vocab", "int", 0, "vocabulary size for wrong tokens (0: any id, wrong = reference + 1)", minimum=0),
)


def manifest(params, env) -> Manifest:
    return Manifest(role="drafter", outputs=(Port("proposal", "proposal"),))


class Oracle(Node):
    def __init__(self, ctx):
        super().__init__(ctx)
        p = ctx.params
        self.reference = list(p["reference"])
        self.errors = set(p["errors"])
        self.wrong_index = set(p["wrong_draft_index"])
        self.vocab = p["vocab"]

    def _wrong(self, tok: int) -> int:
        return (tok + 1) % self.vocab if self.vocab else tok + 1

    def draft(self, req) -> list[int]:
        g = len(req.tokens) - req.prompt_len
        drafts = self.reference[g:g + req.num_draft]
        return [self._wrong(t) if (g + j) in self.errors or j in self.wrong_index else t for j, t in enumerate(drafts)]

    def step(self, batch, inputs):
        rows = [self.draft(req) if req is not None else None for req in batch.rows]
        return {"proposal": Proposal.from_rows(rows, self.ctx.device)}


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="oracle", role="drafter", manifest=manifest, factory=Oracle, params=PARAMS,
        description="test drafter: proposes a reference continuation with injected errors"))
