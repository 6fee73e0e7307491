"""The dflash2 (and dflash) node's `min_path_prob`: a block's drafts cut where the drafter's own confidence runs out."""

from __future__ import annotations

import math

import pytest
import torch

from draftflow.plugins.dflash.dflash2_plugin import PARAMS, confident_width
from draftflow.plugins.dflash.plugin import PARAMS as DFLASH_PARAMS


def block(probs: list[list[float]], vocab: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [B, K, V] whose top token has probability probs[b][k] (the rest share what is left), and the top logit."""
    rows = []
    for row in probs:
        out = []
        for p in row:
            rest = (1 - p) / (vocab - 1)
            out.append([math.log(p)] + [math.log(rest)] * (vocab - 1))
        rows.append(out)
    logits = torch.tensor(rows, dtype=torch.float64)
    return logits, logits[..., 0]


@pytest.mark.parametrize(("probs", "threshold", "width"), [
    ([[0.9, 0.9, 0.5, 0.9]], 0.3, 4),    # running product 0.9, 0.81, 0.405, 0.3645: never under 0.3: all 4
    ([[0.9, 0.9, 0.3, 0.9]], 0.3, 2),    # 0.9, 0.81, 0.243 < 0.3 at row 2: keep rows 0 and 1
    ([[0.2, 0.9, 0.9, 0.9]], 0.3, 1),    # under it at the first row: still one draft
    ([[0.9, 0.9, 0.9, 0.9]], 0.01, 4),   # never under: the whole block
    ([[0.2, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.2]], 0.3, 3),  # a batch: the widest row's cut
])
def test_the_width_stops_before_the_first_row_under_the_threshold(probs, threshold, width):
    logits, _ = block(probs)
    assert confident_width(logits, threshold) == width


def test_the_width_matches_a_loop_over_random_blocks():
    gen = torch.Generator().manual_seed(0)
    for trial in range(100):
        logits = torch.randn(1 + trial % 3, 1 + trial % 15, 50, generator=gen) * (1 + 4 * torch.rand(1, generator=gen))
        for threshold in (0.01, 0.1, 0.5):
            widest = 1
            for row in logits.double():
                path, keep = 1.0, row.shape[0]
                for k, r in enumerate(row):
                    path *= math.exp(r.max().item() - torch.logsumexp(r, -1).item())
                    if path < threshold:
                        keep = k
                        break
                widest = max(widest, keep)
            assert confident_width(logits, threshold) == widest


@pytest.mark.parametrize("params", [PARAMS, DFLASH_PARAMS], ids=["dflash2", "dflash"])
def test_the_param_is_declared_off_by_default_and_never_negative(params):
    spec = next(p for p in params if p.name == "min_path_prob")
    assert spec.type == "float" and spec.default == 0.0 and spec.below_minimum(-0.1) == -0.1
