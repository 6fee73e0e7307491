"""The verifier node: turns target logits and a proposal into a verdict.

Greedy at temperature 0, otherwise lossless rejection sampling (Leviathan et al.) with
temperature, top-k and top-p applied to the target distribution first. The math lives
in ``draftflow.verify`` so plugin authors can call it directly.
"""

from __future__ import annotations

import torch

from draftflow.plugin import Manifest, Node, NodeType, ParamSpec, Port, Verdict, hookimpl
from draftflow.plugins.verifier.accept import greedy_accept, rejection_sample
from draftflow.layers.sampling import filter_logits

PARAMS = (
    ParamSpec("mode", "str", "auto", "auto: greedy at temperature 0, rejection sampling above; greedy: always argmax",
              choices=("auto", "greedy")),
)


def manifest(params, env) -> Manifest:
    provides = {"verify.greedy"} | ({"sampling.temperature>0"} if params["mode"] == "auto" else set())
    return Manifest(
        role="verifier",
        inputs=(Port("logits", "logits", doc="target window logits [B, K+1, V]"),
                Port("proposal", "proposal", required=False, doc="drafts; absent means target-only decoding")),
        outputs=(Port("verdict", "verdict"),),
        provides=provides,
    )


class Verifier(Node):
    def step(self, req, inputs):
        logits = inputs["logits"].logits  # [B, K+1, V]
        proposal = inputs.get("proposal")
        batch = logits.shape[0]
        if proposal is None:
            drafts = torch.empty(batch, 0, dtype=torch.long, device=logits.device)  # [B, 0]
        else:
            drafts = proposal.tokens  # [B, K]
        s = req.sampling
        if self.ctx.params["mode"] == "greedy" or s.temperature == 0:
            accepted, emitted = greedy_accept(drafts, logits)
        else:
            probs = filter_logits(logits, s.temperature, s.top_k, s.top_p)  # [B, K+1, V]
            q = proposal.probs if proposal is not None else None
            cand = proposal.candidate_ids if proposal is not None else None
            accepted, emitted = rejection_sample(drafts, probs, q, cand, generator=req.generator)
        return {"verdict": Verdict(accepted, emitted)}


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="verifier", role="verifier", manifest=manifest, factory=Verifier, params=PARAMS,
        description="greedy or lossless rejection-sampling verification of drafts against the target",
    ))
