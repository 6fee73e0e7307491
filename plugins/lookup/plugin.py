"""The `prompt-lookup` drafter: propose what followed the last earlier occurrence of the suffix.

Model-free (vLLM's n-gram proposer, transformers' prompt lookup): the longest suffix
n-gram of prompt + output (``min_ngram`` <= n <= ``max_ngram``) found earlier in the
sequence, earliest occurrence first, proposes up to K of the tokens that followed it.
Drafts are deterministic (one-hot q). The history lives in a host int64 array sized once
and appended to in ``commit``; the numba matcher is compiled when the node is built.
"""

from __future__ import annotations

import numpy as np
import torch

from draftflow.plugin import Manifest, Node, NodeType, ParamSpec, Port, Proposal, SpecError, Vram, hookimpl
from draftflow.plugins.lookup.matcher import find_continuation, warm_up

PARAMS = (
    ParamSpec("min_ngram", "int", 2, "shortest suffix n-gram that counts as a match", minimum=1),
    ParamSpec("max_ngram", "int", 5, "longest suffix n-gram tried", minimum=1),
)
# History capacity when the plan sets no KV capacity (no model limit); the array doubles when full.
DEFAULT_HISTORY = 4096


def manifest(params, env) -> Manifest:
    lo, hi = params["min_ngram"], params["max_ngram"]
    if not 1 <= lo <= hi:
        raise SpecError(f"min_ngram={lo}, max_ngram={hi}: need 1 <= min_ngram <= max_ngram; e.g. min_ngram: 2, max_ngram: 5")
    # Device memory is only the K-token proposal; the history is host memory (8 B x KV capacity).
    return Manifest(role="drafter", outputs=(Port("proposal", "proposal", doc="up to K copied tokens, probs None"),),
                    vram=Vram(scratch=env.num_draft * 8))


class PromptLookup(Node):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.min_ngram, self.max_ngram = ctx.params["min_ngram"], ctx.params["max_ngram"]
        self.history = np.zeros(ctx.kv_tokens or DEFAULT_HISTORY, dtype=np.int64)  # [capacity]
        self.length = 0
        warm_up()

    def _append(self, tokens: list[int]) -> None:
        end = self.length + len(tokens)
        if end > self.history.shape[0]:
            grown = np.zeros(max(end, 2 * self.history.shape[0]), dtype=np.int64)
            grown[:self.length] = self.history[:self.length]
            self.history = grown
        self.history[self.length:end] = tokens
        self.length = end

    def prefill(self, req):
        self.length = 0
        self._append(req.tokens)
        return {}

    def step(self, req, inputs):
        start, count = find_continuation(self.history, self.length, self.min_ngram, self.max_ngram, req.num_draft)
        drafts = torch.from_numpy(self.history[start:start + count].copy()).to(self.ctx.device)
        return {"proposal": Proposal(drafts.reshape(1, count))}  # tokens: [1, count], count <= K

    def commit(self, req, info):
        self._append(req.tokens[self.length:])
        return {}


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="prompt-lookup", role="drafter", manifest=manifest, factory=PromptLookup, params=PARAMS,
        description="model-free drafter: copies what followed the longest earlier match of the suffix n-gram"))
