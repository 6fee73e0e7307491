"""`python -m draftflow.tools.convert_gguf --outtype`: each tensor gets the type llama.cpp gives it, with gguf's bytes."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from helpers import ROOT, SMALL_PAIR
from safetensors.torch import load_file

from draftflow.layers.gguf_names import hf_to_gguf_name
from draftflow.plugins.target.gguf_loader import load_gguf
from draftflow.tools.convert_gguf import main, use_more_bits
from draftflow.tools.kquants import quantize_k
from draftflow.tools.tiny_model import write_tiny_model

QUANTIZED = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1}
FILE_TYPE = {"q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*
CORPUS = ["the cat sat on the mat; speculative decoding is lossless 12345"] * 4
_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_ONE_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")  # blk.N.ffn_gate.J.weight


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A dense Qwen3 (untied head; intermediate 176, not whole 32-blocks) and a 4-expert Qwen3-MoE, as HF dirs."""
    root = tmp_path_factory.mktemp("hf")
    return {"dense": write_tiny_model(root / "dense", corpus=CORPUS),
            "moe": write_tiny_model(root / "moe", corpus=CORPUS, experts=4, top_k=2)}


def _convert(src, out, outtype: str) -> GGUFReader:
    assert main([str(src), str(out), "--outtype", outtype]) == 0
    return GGUFReader(out)


def _sources(hf_dir) -> dict[str, np.ndarray]:
    """The float32 source weights by llama.cpp name; merged experts stacked [E, out, in] as the converter writes them."""
    weights = {hf_to_gguf_name(n): t.float().numpy() for n, t in load_file(hf_dir / "model.safetensors").items()}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name in [n for n in weights if _ONE_EXPERT.match(n)]:
        layer, part, j = _ONE_EXPERT.match(name).groups()
        experts.setdefault(f"blk.{layer}.ffn_{part}_exps.weight", {})[int(j)] = weights.pop(name)
    return {**weights, **{n: np.stack([per[j] for j in sorted(per)]) for n, per in experts.items()}}


@pytest.mark.parametrize("outtype", QUANTIZED)
def test_each_tensor_gets_llama_cpps_type_and_gguf_quantizer_bytes(models, tmp_path, outtype):
    """Matrices in the type (bytes = gguf's quantizer on the source), norms F32, head Q6_K (its 64-long rows are not
    whole 256-blocks: llama-quantize's Q8_0 fallback), ragged rows F16; it loads."""
    reader = _convert(models["dense"], tmp_path / "m.gguf", outtype)
    assert reader.get_field("general.file_type").contents() == FILE_TYPE[outtype]
    src, qtype = _sources(models["dense"]), QUANTIZED[outtype]
    assert {t.name for t in reader.tensors} == set(src)
    for t in reader.tensors:
        if len(src[t.name].shape) == 1:
            want = Q.F32
        elif t.name == "output.weight":  # llama-quantize's Q6_K head, Q8_0 for rows that are not whole 256-blocks
            want = Q.Q8_0 if outtype == "q8_0" or src[t.name].shape[-1] % 256 else Q.Q6_K
        elif src[t.name].shape[-1] % 32:  # ffn_down rows are 176 long: llama.cpp's converter falls back to F16
            want = Q.F16
        else:
            want = qtype
        assert t.tensor_type == want, (t.name, t.tensor_type.name)
        if want in (Q.F32, Q.F16):
            assert np.array_equal(np.asarray(t.data), src[t.name].astype(np.float32 if want == Q.F32 else np.float16))
        else:
            assert np.array_equal(np.asarray(t.data), gguf.quants.quantize(src[t.name], want)), t.name
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert embd.tensor_type == qtype  # llama-quantize quantizes an untied embedding like any matrix
    stored = {t.name: t for t in reader.tensors}
    for name, w in load_gguf(tmp_path / "m.gguf", "cpu", torch.float32).model.named_parameters():
        t = stored[hf_to_gguf_name(name if name.startswith("lm_head.") else "model." + name)]
        assert torch.equal(w, torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())), name  # it loads


@pytest.mark.parametrize("outtype", ["q4_0", "q5_1"])
def test_tied_embedding_is_the_head_and_goes_q8_0(tmp_path, outtype):
    """In a tied model (the demo target) token_embd is the output head, so it gets the head's type: Q6_K, which
    falls back to Q8_0 for the 128-long rows."""
    reader = _convert(SMALL_PAIR / "target", tmp_path / "m.gguf", outtype)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert "output.weight" not in types and types["token_embd.weight"] == Q.Q8_0
    assert types["blk.0.attn_q.weight"] == types["blk.3.ffn_down.weight"] == QUANTIZED[outtype]


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0", "q4_0"])
def test_moe_router_stays_f32_and_experts_take_the_type(models, tmp_path, outtype):
    """ffn_gate_inp is F32 (its exact float values) whatever --outtype; merged [E, out, in] experts are quantized."""
    reader = _convert(models["moe"], tmp_path / "m.gguf", outtype)
    src = _sources(models["moe"])
    want = {"f16": Q.F16, "bf16": Q.BF16, **QUANTIZED}[outtype]
    routers = [t for t in reader.tensors if t.name.endswith(".ffn_gate_inp.weight")]
    experts = [t for t in reader.tensors if _EXPERTS.match(t.name)]
    assert len(routers) == 2 and len(experts) == 6
    for t in routers:
        assert t.tensor_type == Q.F32 and np.array_equal(np.asarray(t.data), src[t.name]), t.name
    for t in experts:
        assert t.tensor_type == want, (t.name, t.tensor_type.name)
        if outtype in QUANTIZED:
            assert np.array_equal(np.asarray(t.data), gguf.quants.quantize(src[t.name], want)), t.name


def test_other_k_quant_mixes_are_refused_with_llama_quantize_in_the_help(models, tmp_path, capsys):
    """--outtype q3_k_m is not offered; --help says to convert to F16 and run llama-quantize."""
    with pytest.raises(SystemExit) as exc:
        main([str(models["dense"]), str(tmp_path / "m.gguf"), "--outtype", "q3_k_m"])
    assert exc.value.code == 2 and "invalid choice: 'q3_k_m'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--outtype f16" in out and "llama-quantize model-f16.gguf model-Q3_K_M.gguf Q3_K_M" in out
    assert "q4_k_m" in out and "q6_k" in out
    assert not (tmp_path / "m.gguf").exists()


K_MIXES = {"q4_k_m": (Q.Q4_K, 15), "q5_k_m": (Q.Q5_K, 17), "q6_k": (Q.Q6_K, 18)}  # base type, LLAMA_FTYPE_MOSTLY_*


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """8 layers with 256-multiple rows (hidden 256, MLP 512, head dim 64: K-quant blocks fit), untied head; and a
    4-expert MoE whose expert rows (in 256) fit too but whose down rows (moe_intermediate 32) do not."""
    root = tmp_path_factory.mktemp("wide")
    dense = write_tiny_model(root / "dense", vocab=300, hidden=256, layers=8, heads=4, kv_heads=2, intermediate=512,
                             corpus=CORPUS)
    cfg = dense / "config.json"
    cfg.write_text(cfg.read_text().replace('"tie_word_embeddings": true', '"tie_word_embeddings": false'))
    moe = write_tiny_model(root / "moe", vocab=300, hidden=256, layers=2, corpus=CORPUS, experts=4, top_k=2)
    return {"dense": dense, "moe": moe}


def _mix_type(name: str, outtype: str, row: int, layers: int) -> Q:
    """llama-quantize's choice, written out independently of the converter: head Q6_K; attn_v / ffn_down Q6_K on the
    more-bits layers under _M; fallback Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 for rows not whole 256-blocks."""
    base = K_MIXES[outtype][0]
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    more = outtype != "q6_k" and (".attn_v." in name or ".ffn_down" in name) and use_more_bits(layer, layers)
    kind = Q.Q6_K if name == "output.weight" or more else base
    if row % 256:
        kind = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}[kind]
    return kind


def test_use_more_bits_picks_llama_quantizes_layers():
    """32 layers: the first 4, the last 4 and every third from layer 6 (6, 9, ..., 27)."""
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


@pytest.mark.parametrize("outtype", K_MIXES)
def test_k_quant_mixes_write_llama_quantizes_types_with_our_quantizer_bytes(wide, tmp_path, outtype):
    """Every matrix in its mix type with tools.kquants' bytes (gguf's for the fallbacks); it loads exactly as gguf
    dequantizes it; the file type is llama.cpp's."""
    reader = _convert(wide["dense"], tmp_path / "m.gguf", outtype)
    assert reader.get_field("general.file_type").contents() == K_MIXES[outtype][1]
    src = _sources(wide["dense"])
    seen = set()
    for t in reader.tensors:
        if len(src[t.name].shape) == 1:
            assert t.tensor_type == Q.F32
            continue
        want = _mix_type(t.name, outtype, src[t.name].shape[-1], 8)
        assert t.tensor_type == want, (t.name, t.tensor_type.name, want.name)
        quantizer = {Q.Q4_K: "Q4_K", Q.Q5_K: "Q5_K", Q.Q6_K: "Q6_K"}.get(want)
        expect = quantize_k(src[t.name], quantizer) if quantizer else gguf.quants.quantize(src[t.name], want)
        assert np.array_equal(np.asarray(t.data), expect), t.name
        seen.add(want)
    assert {K_MIXES[outtype][0], Q.Q6_K} <= seen  # the mix is really mixed (v/down/head) and the base type is used
    stored = {t.name: t for t in reader.tensors}
    for name, w in load_gguf(tmp_path / "m.gguf", "cpu", torch.float32).model.named_parameters():
        t = stored[hf_to_gguf_name(name if name.startswith("lm_head.") else "model." + name)]
        assert torch.equal(w, torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())), name


def test_q4_k_m_moe_experts_quantized_router_f32(wide, tmp_path):
    """Merged experts: gate/up (256-long rows) Q4_K, down (32-long rows) the Q5_0 fallback -- or, on a more-bits
    layer, Q6_K's Q8_0 fallback; the router stays F32."""
    reader = _convert(wide["moe"], tmp_path / "m.gguf", "q4_k_m")
    src = _sources(wide["moe"])
    types = {t.name: t.tensor_type for t in reader.tensors}
    for layer in range(2):
        assert types[f"blk.{layer}.ffn_gate_inp.weight"] == Q.F32
        assert types[f"blk.{layer}.ffn_gate_exps.weight"] == types[f"blk.{layer}.ffn_up_exps.weight"] == Q.Q4_K
        down = f"blk.{layer}.ffn_down_exps.weight"
        assert types[down] == _mix_type(down, "q4_k_m", src[down].shape[-1], 2)
    assert types["blk.1.ffn_down_exps.weight"] == Q.Q8_0  # 2 layers: both are more-bits layers (the last eighth)


def test_k_quant_mixes_logit_error_ranks_with_bits(wide, tmp_path):
    """The float model's logits against each file's, relative (Frobenius): q8_0 < q6_k < q5_k_m < q4_k_m, and each
    mix below gguf's legacy quantizer of its width (q5_k_m < q5_1, q4_k_m < q4_1). Measured on this random 8-layer
    model (it amplifies weight error): 0.029, 0.093, 0.171 (q5_1 0.197), 0.345 (q4_1 0.393)."""
    from draftflow.layers.kv_cache import KVCache
    from draftflow.plugins.target.hf_loader import load_hf

    def logits(loaded):
        ids = torch.arange(3, 40)[None]
        return loaded.model(ids, 0, KVCache.growing(loaded.config, 1, 64, torch.float32, "cpu"))[0]

    ref = logits(load_hf(wide["dense"], "cpu", torch.float32))
    errors = {}
    for outtype in ("q8_0", "q6_k", "q5_1", "q5_k_m", "q4_1", "q4_k_m"):
        _convert(wide["dense"], tmp_path / f"{outtype}.gguf", outtype)
        got = logits(load_gguf(tmp_path / f"{outtype}.gguf", "cpu", torch.float32))
        errors[outtype] = ((got - ref).norm() / ref.norm()).item()
    assert 0 < errors["q8_0"] < errors["q6_k"] < errors["q5_k_m"] < errors["q4_k_m"], errors
    assert errors["q5_k_m"] < errors["q5_1"] and errors["q4_k_m"] < errors["q4_1"], errors
