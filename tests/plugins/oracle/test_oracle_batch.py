"""The oracle drafter at batch > 1: each row proposes the reference from its own request's progress."""

from __future__ import annotations

import torch

from draftflow.core.plan import Env
from draftflow.plugin import Batch, NodeContext, RequestState, SamplingParams
from draftflow.plugins.oracle.plugin import Oracle, manifest

REFERENCE = [10, 11, 12, 13, 14, 15]


def test_rows_follow_their_own_progress_and_errors():
    """Rows at different output lengths and draft budgets get reference[g:g+k] with the injected errors, padded."""
    params = {"reference": REFERENCE, "errors": [3], "wrong_draft_index": [], "vocab": 0}
    node = Oracle(NodeContext("oracle", params, manifest(params, Env("cpu", "float32", 4, None)), torch.device("cpu"),
                              torch.float32, 4, None, {}, {}, max_batch=4))
    prompt = [1, 2]
    reqs = [RequestState("a", 2, prompt + REFERENCE[:1], SamplingParams(), torch.Generator(), 4, 0, 0), None,
            RequestState("b", 2, prompt + REFERENCE[:4], SamplingParams(), torch.Generator(), 4, 0, 2),
            RequestState("c", 2, list(prompt), SamplingParams(), torch.Generator(), 2, 0, 3)]
    out = node.step(Batch(reqs, 4), {})["proposal"]
    assert out.lengths.tolist() == [4, 0, 2, 2]  # slot 2 is near the reference's end, slot 3 wants 2
    assert out.tokens[0].tolist() == [11, 12, 14, 14]  # output position 3 is wrong (13 + 1)
    assert out.tokens[2, :2].tolist() == [14, 15] and out.tokens[3, :2].tolist() == [10, 11]
    alone = node.step(Batch(reqs[:1], 4), {})["proposal"]
    assert alone.lengths is None and alone.tokens.tolist() == [[11, 12, 14, 14]]
