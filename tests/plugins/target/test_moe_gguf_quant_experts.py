"""A quantized MoE GGUF with `quantized: true`: the merged experts stay in their blocks on the host and the expert
cache dequantizes each upload on the device (layers/quant_experts.py). On the CPU the Triton dequantizer runs under
the interpreter (tests/conftest.py), the same code as on CUDA."""

from __future__ import annotations

import pytest
import torch
from gguf_quant_testlib import cpu_triton
from moe_testlib import VOCAB, build_hf_moe, save_hf_moe

pytest.importorskip("triton")
from draftflow.layers.gguf_quants import weight_lines  # noqa: E402
from draftflow.layers.kv_cache import KVCache  # noqa: E402
from draftflow.layers.moe import HostExperts  # noqa: E402
from draftflow.layers.quant_experts import QuantHostExperts  # noqa: E402
from draftflow.plugins.target.gguf_loader import load_gguf  # noqa: E402
from draftflow.tools.convert_gguf import convert_hf_to_gguf  # noqa: E402

TOKENS = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))  # [1, 12]


def _logits(loaded, resident=None) -> torch.Tensor:
    loaded.model.set_expert_cache(resident)
    return loaded.model(TOKENS, 0, KVCache.growing(loaded.config, 1, 16, torch.float32, "cpu"))[0]  # [1, 12, V]


@cpu_triton
@pytest.mark.parametrize("outtype,qtype,bytes_per_32", [("q8_0", "Q8_0", 34)])  # (the kernel's types: test_quant_kernels)
def test_quantized_experts_upload_their_blocks_and_give_the_dequantized_logits(tmp_path, outtype, qtype, bytes_per_32):
    """Experts kept as the file's blocks: the same logits as the target dequantized at load (float32, to rounding:
    the attention projections run the quantized GEMV there) at full and partial residency, the same uploads, and
    each upload moves the blocks' bytes instead of float32's."""
    path = save_hf_moe(build_hf_moe(layers=2), tmp_path / "hf")
    convert_hf_to_gguf(path, tmp_path / "m.gguf", outtype, "merged")
    kept = load_gguf(tmp_path / "m.gguf", "cpu", torch.float32, quantized=True, repacked=False)
    plain = load_gguf(tmp_path / "m.gguf", "cpu", torch.float32, quantized=False)
    host = kept.model.host_experts
    assert isinstance(host, QuantHostExperts) and isinstance(plain.model.host_experts, HostExperts)
    assert host.types == [(qtype, qtype, qtype)] * 2 and host.shape == plain.model.host_experts.shape
    floats = 3 * kept.config.hidden_size * kept.config.moe_intermediate_size  # weights of one expert
    assert host.bytes_per_expert == floats // 32 * bytes_per_32  # vs floats * 4 bytes at float32
    for resident in (None, 9):  # every expert on the device / 9 of 96: misses uploaded per window
        want, got = _logits(plain, resident), _logits(kept, resident)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
        if resident is None:  # the slots hold exactly the dequantized weights
            assert torch.equal(kept.model.expert_cache.slot_gate_up, plain.model.expert_cache.slot_gate_up)
            assert torch.equal(kept.model.expert_cache.slot_down, plain.model.expert_cache.slot_down)
    got_c, want_c = kept.model.expert_cache.counters(), plain.model.expert_cache.counters()
    assert got_c["expert_misses"] == want_c["expert_misses"] > 0
    assert got_c["expert_upload_bytes"] * floats * 4 == want_c["expert_upload_bytes"] * host.bytes_per_expert
    line = weight_lines(str(tmp_path / "m.gguf"), torch.float32, keep=True)[0]  # what `draftflow check` prints
    assert "; routed experts stay quantized on the host (" in line, line
    assert "routed experts" not in weight_lines(str(tmp_path / "m.gguf"), torch.float32, keep=False)[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quantized_experts_on_cuda_match_the_dequantized_target(tmp_path):
    """CUDA, float32: pinned blocks, staged and dequantized per upload, give the dequantized target's logits at full
    and partial residency (the latter on the host-routed path: a quantized miss cannot be read from host memory)."""
    path = save_hf_moe(build_hf_moe(layers=2), tmp_path / "hf")
    convert_hf_to_gguf(path, tmp_path / "m.gguf", "q8_0", "merged")
    kept = load_gguf(tmp_path / "m.gguf", "cuda", torch.float32, quantized=True)
    plain = load_gguf(tmp_path / "m.gguf", "cuda", torch.float32, quantized=False)
    assert kept.model.host_experts.gate[0].is_pinned()
    tokens = TOKENS.cuda()
    for resident in (None, 9):
        caches = [m.model.set_expert_cache(resident) for m in (kept, plain)]
        assert caches[0].device_path == (resident is None)
        got, want = (m.model(tokens, 0, KVCache.growing(m.config, 1, 16, torch.float32, "cuda"))[0] for m in (kept, plain))
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_experts_the_cache_cannot_keep_quantized_are_named_with_their_cost():
    """Merged experts of a type the dequantizer does not read (Q3_K) go to the host as float: the warning names the
    type, the bytes in the file and in host memory, and the fix."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType as T

    from draftflow.layers.gguf_quants import float_experts_warning

    merged = [SimpleNamespace(tensor_type=T.Q3_K, n_elements=48 * 32 * 256, n_bytes=48 * 32 * 110),
              SimpleNamespace(tensor_type=T.Q4_K, n_elements=48 * 256 * 32, n_bytes=48 * 32 * 144)]
    line = float_experts_warning(merged, torch.bfloat16, "m.gguf")
    assert line.startswith("m.gguf: routed experts of type Q3_K are dequantized at load: 381.00 KiB in the file take "
                           "1.50 MiB of bfloat16 in host memory; the expert cache keeps only Q8_0, "), line
    assert line.endswith("re-quantize to one of those (e.g. Q4_K_M)")


def test_check_refuses_experts_that_do_not_fit_in_host_memory(tmp_path, monkeypatch):
    """`draftflow check` (build_plan) of a MoE graph whose experts need more host memory than is available: one
    host-memory problem naming the bytes, where and the fix (keeping a quantized GGUF's experts in their blocks,
    when that fits), before anything loads; none with enough memory."""
    from moe_testlib import write_moe_graph

    from draftflow.core.budget import fmt_bytes
    from draftflow.core.plan import build_plan
    from draftflow.core.registry import load_registry
    from draftflow.core.spec import load_graph
    from draftflow.layers import quant_experts

    path = save_hf_moe(build_hf_moe(layers=2), tmp_path / "hf")
    convert_hf_to_gguf(path, tmp_path / "m.gguf", "q8_0", "merged")
    graph = write_moe_graph(tmp_path / "g.yaml", tmp_path / "m.gguf", None)
    floats = 2 * 48 * 3 * 64 * 32 * 4  # 2 MoE layers x 48 experts x (gate, up, down) of 64 x 32, float32
    blocks = floats // 4 // 32 * 34  # as Q8_0

    def problems(available):
        monkeypatch.setattr(quant_experts, "available_host_memory", lambda: available)
        return [p for p in build_plan(load_graph(graph), load_registry()).problems if p.rule == "host-memory"]

    assert problems(floats) == []
    [p] = problems(floats - 1)
    assert p.node == "target" and p.where.startswith(str(graph)), p.where
    assert p.message == (f"its 96 routed experts take {fmt_bytes(floats)} of host memory as float32, and this machine "
                         f"has {fmt_bytes(floats - 1)} available")
    assert p.fix == ("set the target's `quantized: true` on a CUDA device: the experts then stay in their GGUF blocks "
                     f"on the host ({fmt_bytes(blocks)})")
    [p] = problems(blocks - 1)
    assert p.fix == "use a quantized GGUF (e.g. Q4_K_M) with `quantized: true`, or a machine with more memory"
    # a CUDA graph with `quantized: true` counts the blocks (the rule's function, as the check calls it there)
    cfg = load_gguf(tmp_path / "m.gguf", "cpu", torch.float32, quantized=False).config
    assert quant_experts.host_memory_problem(cfg, torch.float32, str(tmp_path / "m.gguf"), True, blocks) is None
    message, _ = quant_experts.host_memory_problem(cfg, torch.float32, str(tmp_path / "m.gguf"), True, blocks - 1)
    assert message.startswith(f"its 96 routed experts take {fmt_bytes(blocks)} of host memory as their GGUF blocks")
