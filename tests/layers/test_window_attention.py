"""The shared decoder pieces: fused ops equal the modules, and one attention forward serves eager and bucketed windows."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_close_to_scale

from draftflow.layers.attention import Window
from draftflow.layers.config import TargetConfig
from draftflow.layers.decoder import Attention
from draftflow.layers.fused import PLAIN, fuse_projections, joined, rms
from draftflow.layers.kv_cache import KVCache, static_shape
from draftflow.layers.norm import RMSNorm
from draftflow.layers.rope import rope_inv_freq, rope_tables

BASE = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
            rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=False)
# Qwen3-Next's attention: gated output, partial rotary, (1 + w) norms.
NEXT = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", layer_types=["full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, num_experts=0, partial_rotary_factor=0.25)


@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_equals_the_norm_module_bit_for_bit(offset, dtype):
    """fused.rms rounds exactly where RMSNorm does, (1 + w) offset included."""
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(24, 1e-6, dtype, "cpu", offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=gen))
    x = torch.randn(3, 5, 24, generator=gen).to(dtype)
    torch.testing.assert_close(rms(x, norm.weight, 1e-6, offset), norm(x), atol=0, rtol=0)


def _layer(kind: str, seed: int = 0):
    cfg = TargetConfig.from_hf_dict({**BASE, **(NEXT if kind == "next" else {})}, kind)
    attn = Attention(cfg, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.dim() == 1 else p.shape[-1] ** -0.5))
    return cfg, attn


@pytest.mark.parametrize("kind", ["qwen3", "next"])
def test_bucketed_window_equals_exact_prefix(kind):
    """A device-held start over a bucket (stale cells past the window masked) gives the exact-prefix output and K/V."""
    cfg, attn = _layer(kind)
    inv = rope_inv_freq(cfg)
    gen = torch.Generator().manual_seed(1)
    caches = [KVCache.from_static(torch.zeros(static_shape(cfg, 1, 32))) for _ in range(2)]
    prefix = torch.randn(1, 7, cfg.hidden_size, generator=gen)
    for cache in caches:
        cos, sin = rope_tables(inv, torch.arange(7), torch.float32)
        attn(prefix, cos, sin, cache, 0, window=Window.at(0, 7, "cpu"))
        cache.commit(7)
    caches[1].buffer[:, :, :, 7:].normal_(generator=gen)  # stale cells a rejected window left behind
    x = torch.randn(1, 3, cfg.hidden_size, generator=gen)
    cos, sin = rope_tables(inv, torch.arange(7, 10), torch.float32)
    want = attn(x, cos, sin, caches[0], 0, 7, torch.ones(3, 10, dtype=torch.bool))  # the MTP call form
    got = attn(x, cos, sin, caches[1], 0, window=Window.bucketed(torch.tensor([7]), 3, 16), kernels=PLAIN)
    assert_close_to_scale(got, want, 1e-5, "attention output")
    torch.testing.assert_close(caches[1].buffer[:, :, :, :10], caches[0].buffer[:, :, :, :10], atol=0, rtol=0)


def test_joined_refuses_views_that_would_misroute_gradients():
    """Fused q/k/v views are used for inference only: with gradients on, each projection keeps its own product."""
    cfg, attn = _layer("qwen3")

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Module()])
            self.layers[0].self_attn, self.layers[0].mlp = attn, torch.nn.Module()

    fuse_projections(Stack())
    weights = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    with torch.no_grad():
        assert joined(weights) is not None
    for w in weights:
        w.requires_grad_(True)
    assert joined(weights) is None
    with torch.no_grad():
        assert joined(weights) is not None


def test_every_dense_product_of_a_layer_goes_through_the_kernels_choice():
    """Fused q/k/v and gate/up run `Kernels.matmul`, o_proj and down_proj `Kernels.project` (where the CUDA GEMV
    may take them), and the layer computes what the plain ops compute."""
    from torch import nn

    from draftflow.layers.decoder import MLP
    from draftflow.layers.fused import Kernels

    cfg, attn = _layer("qwen3")
    mlp = MLP(cfg, torch.float32, "cpu")
    layer = nn.Module()
    layer.self_attn, layer.mlp = attn, mlp
    holder = nn.Module()
    holder.layers = [layer]
    fuse_projections(holder)
    seen = []

    class Recording(Kernels):
        def __init__(self):
            super().__init__()
            plain_project, plain_matmul = self.project, self.matmul
            self.matmul = lambda x, w, b=None: seen.append(("matmul", tuple(w.shape))) or plain_matmul(x, w, b)
            self.project = lambda lin, x: seen.append(("project", tuple(lin.weight.shape))) or plain_project(lin, x)

    x = torch.randn(1, 3, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(mlp(x, Recording()), mlp(x), atol=0, rtol=0)
        cos, sin = rope_tables(rope_inv_freq(cfg), torch.arange(3), torch.float32)
        outs = []
        for kernels in (Recording(), PLAIN):
            cache = KVCache.from_static(torch.zeros(static_shape(cfg, 1, 8)))
            outs.append(attn(x, cos, sin, cache, 0, window=Window.at(0, 3, "cpu"), kernels=kernels))
        torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h)
    assert seen == [("matmul", (2 * i, h)), ("project", (h, i)), ("matmul", qkv), ("project", (h, cfg.num_heads * d))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 37])
def test_cuda_attention_keeps_cudnn_out(t):
    """A bfloat16 causal window (a prefill: t = 37; one token) runs no cuDNN attention, whose per-shape graph build
    cost ~6 ms a call at every new prompt length, and equals the math backend's output."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from draftflow.layers.attention import attend, fold

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = fold(torch.randn(1, t, 8, 64, device="cuda", generator=gen, dtype=torch.bfloat16), 2)
    keys, values = (torch.randn(1, t, 2, 64, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    window = Window.at(0, t, "cuda")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = attend(q, keys, values, window)
    assert not [e.name for e in prof.events() if "cudnn" in e.name.lower()]
    with sdpa_kernel([SDPBackend.MATH]):
        ref = attend(q, keys, values, window)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
