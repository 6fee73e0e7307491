"""benchmarks/bench_models.py: random models drawn in place, and host experts aliased across layers."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_models  # noqa: E402
from gpu_hybrid_moe import QWEN3_NEXT_80B, TINY  # noqa: E402

from draftflow.layers.config import TargetConfig  # noqa: E402
from draftflow.layers.rope import rope_inv_freq  # noqa: E402


@pytest.fixture
def cfg():
    return TargetConfig.from_hf_dict({**QWEN3_NEXT_80B, **TINY}, "tiny hybrid moe")


def test_target_is_drawn_once_with_unit_norms_and_a_real_rope_table(cfg):
    """Built on meta and materialised: every weight drawn N(0, 0.02), norms 1, the RoPE buffer recomputed."""
    model, _ = bench_models.target(cfg, "cpu", seed=0, dtype=torch.float32)
    for name, p in model.named_parameters():
        if "norm" in name:
            assert torch.all(p == 1), name
        elif p.numel() > 1000:
            assert 0.015 < p.std().item() < 0.025, name
    assert torch.equal(model.inv_freq, rope_inv_freq(cfg))
    again, _ = bench_models.target(cfg, "cpu", seed=0, dtype=torch.float32)
    assert torch.equal(again.layers[1].mlp.gate.weight, model.layers[1].mlp.gate.weight)  # seeded


def test_aliased_host_experts_share_one_layer_and_the_probe_reads_one_layer(cfg, monkeypatch):
    """alias: every MoE layer's stack is the first layer's memory; the read probe gets the expanded stack itself
    (moe_kernels.host_reads_work then reads a view of its first row, never a copy of every layer)."""
    pytest.importorskip("triton")
    from draftflow.layers import moe_kernels

    gen = torch.Generator().manual_seed(0)
    host = bench_models.host_experts(cfg, "cpu", gen, alias=True, dtype=torch.float32)
    n, e, i, h = len(cfg.moe_layers), cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    assert host.gate_up.shape == (n, e, 2 * i, h) and host.down.shape == (n, e, h, i)
    assert host.gate_up.stride(0) == 0 and host.gate_up[n - 1].data_ptr() == host.gate_up[0].data_ptr()
    assert host.gate_up[0].is_contiguous() and 0.015 < host.down[0].std().item() < 0.025
    seen = []
    monkeypatch.setattr(moe_kernels, "host_reads_work", lambda stack: seen.append(stack) or True)
    assert host.readable_on_device() is True and seen[0].data_ptr() == host.gate_up[0].data_ptr()
    assert seen[0].stride(0) == 0  # the expansion, not a materialised copy
    real = bench_models.host_experts(cfg, "cpu", torch.Generator().manual_seed(0), dtype=torch.float32)
    assert real.gate_up.is_contiguous() and real.down.is_contiguous()
    assert real.down.untyped_storage().data_ptr() == real.gate_up.untyped_storage().data_ptr()  # one host block
