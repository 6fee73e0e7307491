"""The `prompt-lookup` drafter: propose what followed the last earlier occurrence of the suffix.

Model-free (vLLM's n-gram proposer, transformers' prompt lookup): the longest suffix
n-gram of prompt + output (``min_ngram`` <= n <= ``max_ngram``) found earlier in the
sequence, its most recent occurrence first (``occurrence: earliest`` for those peers'
choice), proposes up to K of the tokens that followed it.
Drafts are deterministic (one-hot q). Each request slot has its own history, a row of one
host int64 array sized once and appended to in ``commit``; a batched cycle matches row by
row on the host and sends one padded ``[n, K']`` proposal (K' = the longest match, rows
without a match have length 0). The numba matcher is compiled when the node is built.
"""

from __future__ import annotations

import numpy as np

from draftflow.plugin import Manifest, Node, NodeType, ParamSpec, Port, Proposal, SpecError, Vram, hookimpl
from draftflow.plugins.lookup.matcher import find_continuation, warm_up

PARAMS = (
    ParamSpec("min_ngram", "int", 2, "shortest suffix n-gram that counts as a match", minimum=1),
    ParamSpec("max_ngram", "int", 5, "longest suffix n-gram tried", minimum=1),
    ParamSpec("occurrence", "str", "latest", "which of several equally long matches proposes: the latest (measured "
              "faster on code, docs/DRAFTERS.md) or the earliest (vLLM's and transformers' choice)",
              choices=("latest", "earliest")),
)
# History capacity when the plan sets no KV capacity (no model limit); the array doubles when full.
DEFAULT_HISTORY = 4096


def manifest(params, env) -> Manifest:
    lo, hi = params["min_ngram"], params["max_ngram"]
    if not 1 <= lo <= hi:
        raise SpecError(f"min_ngram={lo}, max_ngram={hi}: need 1 <= min_ngram <= max_ngram; e.g. min_ngram: 2, max_ngram: 5")
    # Device memory is only the K-token proposal; the histories are host memory (8 B x KV capacity x slots).
    return Manifest(role="drafter", outputs=(Port("proposal", "proposal", doc="up to K copied tokens, probs None"),),
                    vram=Vram(scratch=env.num_draft * 8))


class PromptLookup(Node):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.min_ngram, self.max_ngram = ctx.params["min_ngram"], ctx.params["max_ngram"]
        self.latest = ctx.params["occurrence"] == "latest"
        self.history = np.zeros((ctx.max_batch, ctx.kv_tokens or DEFAULT_HISTORY), dtype=np.int64)  # [slots, capacity]
        self.lengths = [0] * ctx.max_batch  # tokens of each slot's history
        warm_up()

    def _append(self, slot: int, tokens: list[int]) -> None:
        start = self.lengths[slot]
        end = start + len(tokens)
        if end > self.history.shape[1]:
            grown = np.zeros((self.history.shape[0], max(end, 2 * self.history.shape[1])), dtype=np.int64)
            grown[:, :self.history.shape[1]] = self.history
            self.history = grown
        self.history[slot, start:end] = tokens
        self.lengths[slot] = end

    def prefill(self, req):
        self.lengths[req.slot] = 0
        self._append(req.slot, req.tokens)
        return {}

    def step(self, batch, inputs):
        rows = [self._draft(i, req) if req is not None else None for i, req in enumerate(batch.rows)]
        return {"proposal": Proposal.from_rows(rows, self.ctx.device)}

    def _draft(self, slot: int, req) -> list[int]:
        start, count = find_continuation(self.history[slot], self.lengths[slot], self.min_ngram, self.max_ngram,
                                         req.num_draft, self.latest)
        return self.history[slot, start:start + count].tolist()

    def commit(self, req, info):
        self._append(req.slot, req.tokens[self.lengths[req.slot]:])
        return {}

    def release(self, req):
        self.lengths[req.slot] = 0


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="prompt-lookup", role="drafter", manifest=manifest, factory=PromptLookup, params=PARAMS,
        description="model-free drafter: copies what followed the longest earlier match of the suffix n-gram"))
