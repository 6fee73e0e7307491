"""A GGUF target that keeps its projections quantized (QuantLinear + Triton kernels) computes what the
dequantized-at-load target computes; the VRAM plan and `draftflow check` count the bytes it holds.

On the CPU the loader is asked to keep the blocks (`quantized=True`) and the kernels run under
Triton's interpreter; on CUDA the target keeps them by default, eagerly and under CUDA graphs.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf_quant_testlib import build_qwen3_256, cpu_triton, retype  # noqa: E402
from structlog.testing import capture_logs  # noqa: E402
from torch import nn  # noqa: E402

from draftflow.core.plan import Env  # noqa: E402
from draftflow.layers.gguf_quants import weight_lines  # noqa: E402
from draftflow.layers import quant_linear  # noqa: E402
from draftflow.layers.kv_cache import KVCache, static_shape  # noqa: E402
from draftflow.layers.quant_linear import QuantLinear  # noqa: E402
from draftflow.plugins.target.gguf_loader import _warn_dequantized, load_gguf  # noqa: E402
from draftflow.plugins.target.graphs import GraphRunner  # noqa: E402
from draftflow.plugins.target.plugin import PARAMS, manifest  # noqa: E402
from draftflow.tools.convert_gguf import convert_hf_to_gguf  # noqa: E402

CUDA = torch.cuda.is_available()
# Q4_K_M-like: q/k Q4_K next to a Q6_K v (one fused q/k/v output from two kernels), o Q8_0, gate/up Q4_0 (one
# joined product), down Q3_K (no kernel: dequantized at load), the embedding and head quantized but dequantized.
MIX = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q8_0, "ffn_gate": T.Q4_0,
       "ffn_up": T.Q4_0, "ffn_down": T.Q3_K, "token_embd": T.Q4_0, "output": T.Q6_K}
PROMPT = torch.tensor([[5, 17, 99, 3, 250, 41]])  # [1, 6]


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """The 256-wide tiny Qwen3 as an F32 GGUF re-typed to MIX."""
    root = tmp_path_factory.mktemp("kept")
    build_qwen3_256().save_pretrained(root / "hf", safe_serialization=True)
    convert_hf_to_gguf(root / "hf", root / "f32.gguf", "f32")
    retype(root / "f32.gguf", root / "q.gguf", lambda name: MIX[name.split(".")[-2]])
    return root / "q.gguf"


def greedy(model, cfg, device, steps: int, runner: bool = False,
           forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after PROMPT (prefill eager, then one-token windows eager or through a GraphRunner) and the
    logits that chose them [steps, V]; `forced`: feed these tokens instead of the argmax (teacher forcing)."""
    cache = KVCache.from_static(torch.zeros(static_shape(cfg, 1, 64), dtype=model.embed_tokens.weight.dtype,
                                            device=device))
    prompt = PROMPT.to(device)
    with torch.inference_mode():
        logits, _ = model(prompt, 0, cache)
        cache.commit(prompt.shape[1])
        step = GraphRunner(model, cache, 1, capture=CUDA, compiled=CUDA) if runner else None
        tokens, seen = [int(logits[0, -1].argmax())], [logits[0, -1].float().clone()]
        for i, pos in enumerate(range(prompt.shape[1], prompt.shape[1] + steps - 1)):
            fed = tokens[-1] if forced is None else forced[i]
            if step is not None:
                out, _ = step(fed, None, pos)
            else:
                out, _ = model(torch.tensor([[fed]], device=device), pos, cache)
            cache.commit(pos + 1)
            tokens.append(int(out[0, -1].argmax()))
            seen.append(out[0, -1].float().clone())
    return tokens, torch.stack(seen)


def test_covered_projections_stay_as_file_bytes(mixed_gguf):
    """Covered projections become QuantLinear holding the file's bytes; Q3_K, the embedding and the head are float."""
    loaded = load_gguf(mixed_gguf, "cpu", torch.float32, quantized=True, repacked=False)
    layer = loaded.model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    kinds = {name: getattr(getattr(attn if hasattr(attn, name) else mlp, name), "qtype", None)
             for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
    assert kinds == {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q8_0", "gate_proj": "Q4_0",
                     "up_proj": "Q4_0", "down_proj": None}
    assert isinstance(layer.mlp.down_proj, nn.Linear) and loaded.model.lm_head.weight.dtype == torch.float32
    raw = {t.name: t.data for t in gguf.GGUFReader(mixed_gguf).tensors}
    assert torch.equal(layer.self_attn.v_proj.blocks, torch.from_numpy(np.array(raw["blk.1.attn_v.weight"])))


@cpu_triton
def test_kept_quantized_equals_dequantized_at_load(mixed_gguf):
    """float32: the kept-quantized target's logits equal the dequantized target's to rounding; same greedy tokens,
    eagerly and through the graph runner (fused q/k/v from two kernel types, joined gate/up)."""
    kept = load_gguf(mixed_gguf, "cpu", torch.float32, quantized=True, repacked=False)
    plain = load_gguf(mixed_gguf, "cpu", torch.float32, quantized=False)
    want_tokens, want = greedy(plain.model, plain.config, "cpu", 4)
    got_tokens, got = greedy(kept.model, kept.config, "cpu", 4)
    assert (got[0] - want[0]).abs().max() <= 1e-4 * want[0].abs().max()  # the prompt (dequantize + matmul path)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert got_tokens == want_tokens
    assert greedy(kept.model, kept.config, "cpu", 3, runner=True)[0] == want_tokens[:3]
    assert kept.model.layers[0].mlp.up_proj.blocks.untyped_storage().data_ptr() == \
        kept.model.layers[0].mlp.gate_proj.blocks.untyped_storage().data_ptr()  # fuse_projections joined them


@cpu_triton
@pytest.mark.parametrize("arch,kwargs", [("llama", {"kv_heads": 2}), ("qwen2", {"tied": True})], ids=["llama", "qwen2"])
def test_q8_0_llama_rows_and_qwen2_biases(hf_dir, tmp_path, arch, kwargs):
    """llama's q/k block rows are un-permuted like the weights; qwen2's q/k/v biases are added by the kernel."""
    _, path = hf_dir(arch, **kwargs)
    convert_hf_to_gguf(path, tmp_path / "m.gguf", "q8_0")
    kept = load_gguf(tmp_path / "m.gguf", "cpu", torch.float32, quantized=True, repacked=False)
    plain = load_gguf(tmp_path / "m.gguf", "cpu", torch.float32, quantized=False)
    attn = kept.model.layers[0].self_attn
    assert attn.q_proj.qtype == "Q8_0" and (attn.q_proj.bias is not None) == (arch == "qwen2")
    assert torch.equal(attn.q_proj.dequantized(torch.float32), plain.model.layers[0].self_attn.q_proj.weight)
    tokens = torch.tensor([[3, 9, 27, 11]])
    want = plain.model(tokens, 0, KVCache.growing(plain.config, 1, 8, torch.float32, "cpu"))[0]
    got = kept.model(tokens, 0, KVCache.growing(kept.config, 1, 8, torch.float32, "cpu"))[0]
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@cpu_triton
def test_moe_target_keeps_attention_and_dense_mlp_quantized(tmp_path):
    """qwen3moe Q8_0: attention and the dense layer's MLP stay quantized, routed experts stay in their blocks on the
    host (test_moe_gguf_quant_experts.py); logits equal the dequantized target's to rounding."""
    from moe_testlib import build_hf_moe, save_hf_moe

    path = save_hf_moe(build_hf_moe(layers=2, mlp_only_layers=(1,)), tmp_path / "hf")
    convert_hf_to_gguf(path, tmp_path / "m.gguf", "q8_0")
    kept = load_gguf(tmp_path / "m.gguf", "cpu", torch.float32, quantized=True, repacked=False)
    plain = load_gguf(tmp_path / "m.gguf", "cpu", torch.float32, quantized=False)
    layers = kept.model.layers
    assert layers[0].self_attn.o_proj.qtype == "Q8_0" and layers[1].mlp.down_proj.qtype == "Q8_0"
    assert kept.model.host_experts.types[0] == ("Q8_0", "Q8_0", "Q8_0")
    tokens = torch.tensor([[3, 9, 27, 11]])
    logits = []
    for loaded in (kept, plain):
        loaded.model.set_expert_cache(None)
        logits.append(loaded.model(tokens, 0, KVCache.growing(loaded.config, 1, 8, torch.float32, "cpu"))[0])
    assert (logits[0] - logits[1]).abs().max() <= 1e-4 * logits[1].abs().max()


def _params(path, **over) -> dict:
    return {**{p.name: p.default for p in PARAMS}, "path": str(path), **over}


def test_vram_plan_counts_the_bytes_the_target_holds(mixed_gguf, monkeypatch):
    """On CUDA the plan's weights are the quantized bytes of kept projections plus float bytes of the rest: what the
    loaded model's tensors take; `quantized: false` (and the CPU) count everything dequantized; check says which.
    (The file's blocks as they are: the repacked layout's plan is test_gguf_repacked's.)"""
    monkeypatch.setattr(quant_linear, "REPACK", False)
    env = Env("cuda", "float32", 0, 256)
    kept = load_gguf(mixed_gguf, "cpu", torch.float32, quantized=True, repacked=False)
    held = sum(t.nbytes for name, t in kept.model.state_dict().items() if name != "inv_freq")
    assert manifest(_params(mixed_gguf, quantized=True), env).vram.weights == held
    plain = manifest(_params(mixed_gguf), env).vram.weights  # the default: dequantized at load
    assert plain == manifest(_params(mixed_gguf), Env("cpu", "float32", 0, 256)).vram.weights > held
    line = weight_lines(str(mixed_gguf), torch.float32, keep=True)[0]
    assert line.startswith("weights of q.gguf: ") and "Q4_0, Q4_K, Q6_K, Q8_0 projections stay quantized on the GPU" \
        in line and "the rest dequantized to float32 at load" in line, line


def test_warning_names_what_the_kernels_do_not_cover(mixed_gguf):
    """A CUDA load keeping projections warns once, about the uncovered Q3_K projections only, with their cost."""
    tensors = gguf.GGUFReader(mixed_gguf).tensors
    stay = [t for t in tensors if t.name.split(".")[-2] in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                            "ffn_up")]
    with capture_logs() as logs:
        _warn_dequantized(tensors, stay, torch.bfloat16, "q.gguf")
    assert len(logs) == 1, logs
    assert logs[0]["event"].startswith("q.gguf: Q3_K weights are dequantized at load: 55.00 KiB in the file take "
                                       "256.00 KiB of bfloat16 on the GPU; the GPU kernels keep only Q8_0, Q4_0"), logs


# --- CUDA: the loader's default on CUDA keeps the projections quantized ------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("repacked", [False, True], ids=["file-blocks", "repacked"])
def test_cuda_kept_quantized_generates_like_dequantized(mixed_gguf, dtype, repacked):
    """CUDA: same greedy tokens as the dequantized-at-load target (float32), eagerly and under CUDA graphs;
    bfloat16 logits within 2% of the magnitude (the kernels round the weight as the bf16 model does, but sum in
    another order); with the file's blocks and repacked at load (layers/quant_repack.py)."""
    kept = load_gguf(mixed_gguf, "cuda", dtype, repacked=repacked)
    plain = load_gguf(mixed_gguf, "cuda", dtype, quantized=False)
    assert isinstance(kept.model.layers[0].self_attn.q_proj, QuantLinear)
    want_tokens, want = greedy(plain.model, plain.config, "cuda", 12)
    got_tokens, got = greedy(kept.model, kept.config, "cuda", 12, forced=want_tokens)
    graph_tokens, graph = greedy(kept.model, kept.config, "cuda", 12, runner=True, forced=want_tokens)
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got - want).abs().max() <= rtol * want.abs().max()
    assert (graph - want).abs().max() <= rtol * want.abs().max()
    if dtype == torch.float32:  # teacher-forced on the dequantized target's tokens, each step picks the same token
        assert got_tokens == want_tokens and graph_tokens == want_tokens
