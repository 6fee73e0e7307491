"""A GGUF target whose kept projections are repacked at load (quant_repack + quant_gemv_repacked) computes what the
dequantized-at-load target computes; the VRAM plan and `draftflow check` count the repacked bytes it holds.

On the CPU the loader is asked to keep and repack the blocks and the kernels run under Triton's interpreter; the CUDA
test (eager and under CUDA graphs) is test_gguf_kept_quantized's, parametrized over both layouts.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from gguf_quant_testlib import cpu_triton  # noqa: E402
from test_gguf_kept_quantized import _params, greedy, mixed_gguf  # noqa: E402,F401  (mixed_gguf: a fixture)

from draftflow.core.plan import Env  # noqa: E402
from draftflow.layers import quant_linear  # noqa: E402
from draftflow.layers.fused import fused_linear  # noqa: E402
from draftflow.layers.gguf_quants import weight_lines  # noqa: E402
from draftflow.layers.quant_linear import QuantLinear  # noqa: E402
from draftflow.plugins.target.gguf_loader import load_gguf  # noqa: E402
from draftflow.plugins.target.plugin import manifest  # noqa: E402


@cpu_triton
def test_repacked_target_generates_like_dequantized(mixed_gguf, monkeypatch):
    """float32: the repacked target (Q4_K q/k next to a Q6_K v, Q8_0 o, joined Q4_0 gate/up) gives the dequantized
    target's logits to rounding and its greedy tokens, eagerly and through the graph runner."""
    kept = load_gguf(mixed_gguf, "cpu", torch.float32, quantized=True, repacked=True)
    plain = load_gguf(mixed_gguf, "cpu", torch.float32, quantized=False)
    real = QuantLinear.product
    attn = kept.model.layers[1].self_attn
    assert isinstance(attn.v_proj, QuantLinear) and attn.v_proj.qtype == "Q6_K"
    assert attn.v_proj.blocks is None and attn.v_proj.packed is not None  # the file's bytes are freed
    assert torch.equal(attn.q_proj.dequantized(torch.float32), plain.model.layers[1].self_attn.q_proj.weight)
    want_tokens, want = greedy(plain.model, plain.config, "cpu", 3)
    got_tokens, got = greedy(kept.model, kept.config, "cpu", 3)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert got_tokens == want_tokens
    assert greedy(kept.model, kept.config, "cpu", 3, runner=True)[0] == want_tokens
    mlp = kept.model.layers[0].mlp  # fuse_projections (the runner) joined the repacked gate/up rows
    assert mlp.up_proj.packed.untyped_storage().data_ptr() == mlp.gate_proj.packed.untyped_storage().data_ptr()
    # q/k (Q4_K) joined beside the Q6_K v: one kernel for both, one for v; a q/k/v product is two launches
    assert attn.k_proj.packed.untyped_storage().data_ptr() == attn.q_proj.packed.untyped_storage().data_ptr()
    assert attn.v_proj.packed.untyped_storage().data_ptr() != attn.q_proj.packed.untyped_storage().data_ptr()
    products = []
    monkeypatch.setattr(QuantLinear, "product", lambda self, *a, **k: products.append(self) or real(self, *a, **k))
    x = torch.randn(2, attn.q_proj.in_features)
    qkv = fused_linear(x, [attn.q_proj, attn.k_proj, attn.v_proj])
    assert [id(p) for p in products] == [id(attn.q_proj), id(attn.v_proj)]
    want = torch.cat([real(m, x, m.data, None) for m in (attn.q_proj, attn.k_proj, attn.v_proj)], 1)
    assert (qkv - want).abs().max() <= 1e-5 * want.abs().max()  # a joined product may split its sums otherwise


def test_vram_plan_counts_repacked_bytes(mixed_gguf, monkeypatch):
    """With quant_linear.REPACK on (the default), the loader repacks and the plan's weights are what the repacked
    model holds (a little more than the file's blocks, which the plan counts with REPACK off); `check` says the
    projections are repacked."""
    env = Env("cuda", "float32", 0, 256)
    monkeypatch.setattr(quant_linear, "REPACK", False)
    file_plan = manifest(_params(mixed_gguf, quantized=True), env).vram.weights
    monkeypatch.setattr(quant_linear, "REPACK", True)
    kept = load_gguf(mixed_gguf, "cpu", torch.float32, quantized=True)
    assert kept.model.layers[0].self_attn.o_proj.packed is not None
    held = sum(t.nbytes for name, t in kept.model.state_dict().items() if name != "inv_freq")
    assert manifest(_params(mixed_gguf, quantized=True), env).vram.weights == held > file_plan
    line = weight_lines(str(mixed_gguf), torch.float32, keep=True)[0]
    assert "Q4_0, Q4_K, Q6_K, Q8_0 projections stay quantized on the GPU (" in line and ", repacked), " in line, line
