"""The hybrid target on CUDA: the torch path matches the CPU in float32; fla's bf16 prefill tracks the torch path."""

from __future__ import annotations

import pytest
import torch
from hybrid_testlib import VOCAB, build_hybrid, save

from draftflow.layers import gdn
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.layers.kv_cache import KVCache
from draftflow.layers.linear_state import LinearState

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SPLIT = 190  # prefill chunk (chunked form), then a 10-token window (recurrent form)


def _logits(loaded, tokens: torch.Tensor, device: str, dtype: torch.dtype, use_fla: bool) -> torch.Tensor:
    """Prefill tokens[:SPLIT] as one chunk, then the rest as one window; float32 logits of both parts on the CPU."""
    for layer in loaded.model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.use_fla = use_fla
    state = LinearState.allocate(loaded.config, 1, 16, dtype, device)
    cache = KVCache.growing(loaded.config, 1, 512, dtype, device)
    first, _ = loaded.model(tokens[:, :SPLIT], 0, cache, linear=state)
    cache.commit(SPLIT)
    state.commit(SPLIT)
    second, _ = loaded.model(tokens[:, SPLIT:], SPLIT, cache, linear=state)
    return torch.cat([first, second], dim=1).float().cpu()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = save(build_hybrid(seed=0, head_scale=4.0), tmp_path_factory.mktemp("hybrid") / "m")
    tokens = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(0))
    return path, tokens


def test_float32_on_cuda_matches_cpu(setup):
    """float32 on CUDA (fla requested but skipped: its dots are TF32) gives the CPU logits to 1e-3 relative."""
    path, tokens = setup
    want = _logits(load_hf(path, "cpu", torch.float32), tokens, "cpu", torch.float32, False)
    got = _logits(load_hf(path, "cuda", torch.float32), tokens.cuda(), "cuda", torch.float32, True)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-3, f"max relative error {err:.2e}"


@pytest.mark.skipif(not gdn.fla_available(), reason="fla (draftflow[fla]) not installed")
def test_fla_bf16_prefill_tracks_the_torch_path(setup):
    """bf16 with fla's chunked prefill stays as close to float32 as the bf16 torch path does (relative norm)."""
    path, tokens = setup
    want = _logits(load_hf(path, "cpu", torch.float32), tokens, "cpu", torch.float32, False)
    on_gpu = load_hf(path, "cuda", torch.bfloat16)
    errs = {}
    for use_fla in (False, True):
        got = _logits(on_gpu, tokens.cuda(), "cuda", torch.bfloat16, use_fla)
        errs[use_fla] = ((got - want).norm() / want.norm()).item()
    print(f"bf16 relative-norm error vs float32: torch {errs[False]:.2e}, fla {errs[True]:.2e}")
    assert errs[True] < 2 * errs[False] + 1e-3, errs
