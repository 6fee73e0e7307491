"""The CUDA greedy verdict (argmax, then one Triton program per row) equals the torch rule on the CPU."""

from __future__ import annotations

import pytest
import torch

from draftflow.verify import greedy_accept

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("k", [0, 1, 4, 15, 16, 31])
def test_cuda_greedy_verdict_equals_the_torch_rule(k):
    """Random logits, drafts that follow the argmax for a random prefix (then diverge), capped columns of -1."""
    gen = torch.Generator().manual_seed(k)
    b, vocab = 9, 1000
    logits = torch.randn(b, k + 1, vocab, generator=gen)  # [B, K+1, V]
    drafts = logits.argmax(-1)[:, :k].clone()  # [B, K]: every draft right
    for row in range(b):  # row 0 keeps them all; the others go wrong at a random column
        if row and k:
            col = int(torch.randint(0, k, (1,), generator=gen))
            drafts[row, col] = (drafts[row, col] + 1) % vocab
    if k > 2:
        drafts[1, k - 1:] = -1  # a capped row (capped_drafts): -1 matches no argmax
    want = greedy_accept(drafts, logits)
    got = greedy_accept(drafts.cuda(), logits.cuda())
    assert got[0].dtype == got[1].dtype == torch.int64 and got[1].shape == (b, k + 1)
    assert got[0].cpu().tolist() == want[0].tolist() and got[1].cpu().tolist() == want[1].tolist()
    if k:
        assert got[0][0].item() == k  # the full match emits the bonus too
