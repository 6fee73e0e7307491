"""The hybrid target on CUDA: the flash-linear-attention prefill and the eager window path agree with the CPU."""

from __future__ import annotations

import pytest
import torch
from hybrid_testlib import VOCAB, build_hybrid, save

from draftflow.plugins.target import gdn
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.plugins.target.kv_cache import KVCache
from draftflow.plugins.target.linear_state import LinearState

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _logits(loaded, tokens: torch.Tensor, device: str, use_fla: bool, split: int) -> torch.Tensor:
    """Prefill tokens[:split] as one chunk, then the rest as one verify-sized window; logits of both parts."""
    for layer in loaded.model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.use_fla = use_fla
    state = LinearState.allocate(loaded.config, 1, 16, torch.float32, device)
    cache = KVCache.growing(loaded.config, 1, 512, torch.float32, device)
    first, _ = loaded.model(tokens[:, :split], 0, cache, linear=state)
    cache.commit(split)
    state.commit(split)
    second, _ = loaded.model(tokens[:, split:], split, cache, linear=state)
    return torch.cat([first, second], dim=1).cpu()


def test_cuda_paths_match_cpu(tmp_path):
    """fla chunked prefill (when installed) and the torch path on CUDA give the CPU logits (float32, 1e-3 relative)."""
    path = save(build_hybrid(seed=0, head_scale=4.0), tmp_path / "m")
    tokens = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(0))
    want = _logits(load_hf(path, "cpu", torch.float32), tokens, "cpu", False, 190)
    on_gpu = load_hf(path, "cuda", torch.float32)
    modes = [False] + ([True] if gdn.fla_available() else [])
    for use_fla in modes:
        got = _logits(on_gpu, tokens.cuda(), "cuda", use_fla, 190)
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-3, f"use_fla={use_fla}: max relative error {err:.2e}"
    print(f"fla available: {gdn.fla_available()}")
