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
from draftflow.tools.convert_gguf import main
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
    """Matrices in the type (bytes = gguf's quantizer on the source), norms F32, head Q8_0, ragged rows F16; it loads."""
    reader = _convert(models["dense"], tmp_path / "m.gguf", outtype)
    assert reader.get_field("general.file_type").contents() == FILE_TYPE[outtype]
    src, qtype = _sources(models["dense"]), QUANTIZED[outtype]
    assert {t.name for t in reader.tensors} == set(src)
    for t in reader.tensors:
        if len(src[t.name].shape) == 1:
            want = Q.F32
        elif t.name == "output.weight":  # llama-quantize's Q6_K head; gguf cannot write Q6_K
            want = Q.Q8_0
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
    """In a tied model (the demo target) token_embd is the output head, so it gets the head's Q8_0."""
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


def test_k_quants_are_refused_with_llama_quantize_in_the_help(models, tmp_path, capsys):
    """--outtype q4_k_m is not offered; --help says to convert to F16 and run llama-quantize."""
    with pytest.raises(SystemExit) as exc:
        main([str(models["dense"]), str(tmp_path / "m.gguf"), "--outtype", "q4_k_m"])
    assert exc.value.code == 2 and "invalid choice: 'q4_k_m'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--outtype f16" in out and "llama-quantize model-f16.gguf model-Q4_K_M.gguf Q4_K_M" in out
    assert not (tmp_path / "m.gguf").exists()
