"""Every supported GGUF type loads equal to gguf's numpy dequantizer; quantized files run end to end."""

from __future__ import annotations

import json
import os
import re

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_quant_testlib import ALL_TYPES, build_qwen3_256, retype, set_type_id
from helpers import run_cli
from moe_testlib import build_hf_moe, save_hf_moe

from draftflow.layers.gguf_names import hf_to_gguf_name
from draftflow.layers.kv_cache import KVCache
from draftflow.plugins.target.gguf_loader import load_gguf
from draftflow.tools.convert_gguf import convert_hf_to_gguf

TOKENS = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(5))  # [2, 12]
ENV = {**os.environ, "DRAFTFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"}


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory):
    """The 256-wide tiny Qwen3 as an F32 GGUF, written by our converter."""
    root = tmp_path_factory.mktemp("q256")
    build_qwen3_256().save_pretrained(root / "hf", safe_serialization=True)
    convert_hf_to_gguf(root / "hf", root / "f32.gguf", "f32")
    return root / "f32.gguf"


def _logits(loaded) -> torch.Tensor:
    if loaded.config.moe_layers:
        loaded.model.set_expert_cache(None)
    cache = KVCache.growing(loaded.config, 2, 32, torch.float32, "cpu")
    return loaded.model(TOKENS, 0, cache)[0]  # [2, 12, V]


def _assert_weights_equal(loaded, want: dict[str, np.ndarray]) -> None:
    for name, w in loaded.model.state_dict().items():
        if name == "inv_freq":
            continue
        ref = want[hf_to_gguf_name(name if name.startswith("lm_head.") else "model." + name)]
        assert torch.equal(w, torch.from_numpy(np.array(ref))), name


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_every_type_loads_equal_to_gguf_dequantize(f32_gguf, tmp_path, qtype):
    """All 2-D weights stored as one type load exactly as gguf.quants.dequantize gives them (float32)."""
    want = retype(f32_gguf, tmp_path / "q.gguf", lambda name: qtype, reference=tmp_path / "ref.gguf")
    assert {t.tensor_type for t in gguf.GGUFReader(tmp_path / "q.gguf").tensors if len(t.shape) == 2} == {qtype}
    loaded = load_gguf(tmp_path / "q.gguf", "cpu", torch.float32)
    _assert_weights_equal(loaded, want)
    assert torch.equal(_logits(loaded), _logits(load_gguf(tmp_path / "ref.gguf", "cpu", torch.float32)))


def test_dequantizes_to_the_graph_dtype(f32_gguf, tmp_path):
    """A bfloat16 graph gets gguf's float32 dequantization cast to bfloat16."""
    want = retype(f32_gguf, tmp_path / "q.gguf", lambda name: T.Q6_K)
    loaded = load_gguf(tmp_path / "q.gguf", "cpu", torch.bfloat16)
    w = loaded.model.layers[1].mlp.down_proj.weight
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, torch.from_numpy(want["blk.1.ffn_down.weight"]).to(torch.bfloat16))


MIX = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q4_K, "ffn_gate": T.Q4_0,
       "ffn_up": T.Q8_0, "ffn_down": T.Q5_K, "token_embd": T.Q4_0, "output": T.Q6_K}


def _mixed(name: str):
    """A Q4_K_M-like mix (K-quants from bytes, Q8_0/Q4_0 from gguf's quantizer)."""
    return MIX[name.split(".")[-2]]


def test_mixed_file_generates_like_its_f32_dequantization(f32_gguf, tmp_path):
    """`draftflow generate --json` on a mixed Q4_K/Q6_K/Q5_K/Q8_0/Q4_0 file == on the F32 file of its dequantized weights."""
    retype(f32_gguf, tmp_path / "q.gguf", _mixed, reference=tmp_path / "ref.gguf")
    quant, ref = load_gguf(tmp_path / "q.gguf", "cpu", torch.float32), load_gguf(tmp_path / "ref.gguf", "cpu", torch.float32)
    assert torch.equal(_logits(quant), _logits(ref))
    outs = []
    for f in ("q.gguf", "ref.gguf"):
        r = run_cli(["generate", "--target", tmp_path / f, "--prompt-ids", "5,17,99,3", "--max-new-tokens", "12",
                     "--ignore-eos", "--json"], cwd=tmp_path, env=ENV)
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout)["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 12


def test_check_shows_types_per_group(f32_gguf, tmp_path):
    """`draftflow check` lists tensor types per group and the dequantized bytes the VRAM plan counts."""
    retype(f32_gguf, tmp_path / "q.gguf", _mixed)
    graph = tmp_path / "g.yaml"
    graph.write_text(f"name: q\ndevice: cpu\ndtype: float32\nnodes:\n  target:\n    plugin: target\n    params:\n"
                     f"      path: {tmp_path / 'q.gguf'}\n  verify:\n    plugin: verifier\n")
    r = run_cli(["check", graph], cwd=tmp_path, env=ENV)
    assert r.returncode == 0, r.stderr
    assert "weights of q.gguf: " in r.stdout and "dequantized to float32 at load" in r.stdout, r.stdout
    assert "attention: Q4_K x 6, Q6_K x 2" in r.stdout and "mlp: Q4_0 x 2, Q8_0 x 2, Q5_K x 2" in r.stdout
    assert "embeddings: Q4_0 x 1, Q6_K x 1" in r.stdout and "norms+biases: F32 x" in r.stdout


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q5_1, T.IQ4_NL], ids=lambda t: t.name)
def test_moe_merged_experts_quantized(tmp_path, qtype):
    """qwen3moe with quantized merged ffn_*_exps (and router) loads equal to gguf's dequantization, same logits."""
    path = save_hf_moe(build_hf_moe(layers=3, mlp_only_layers=(1,)), tmp_path / "hf")
    convert_hf_to_gguf(path, tmp_path / "f32.gguf", "f32")
    want = retype(tmp_path / "f32.gguf", tmp_path / "q.gguf", lambda n: qtype if "_exps" in n or "gate_inp" in n else None,
                  reference=tmp_path / "ref.gguf")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(tmp_path / "q.gguf").tensors}
    assert types["blk.0.ffn_down_exps.weight"] == qtype and types["blk.2.ffn_gate_inp.weight"] == qtype
    loaded = load_gguf(tmp_path / "q.gguf", "cpu", torch.float32)
    host, i = loaded.model.host_experts, 32
    gate = torch.from_numpy(want["blk.2.ffn_gate_exps.weight"])  # [E, I, H]
    down = torch.from_numpy(want["blk.2.ffn_down_exps.weight"])  # [E, H, I]
    row = host.layers.index(2)
    assert torch.equal(host.gate_up[row, :, :i], gate) and torch.equal(host.down[row], down)
    assert torch.equal(_logits(loaded), _logits(load_gguf(tmp_path / "ref.gguf", "cpu", torch.float32)))


def _q8(path, tmp_path):
    """The tiny 64-wide Qwen3 as Q8_0 (rows of 64 and 96 weights)."""
    convert_hf_to_gguf(path, tmp_path / "m.gguf", "q8_0")
    return tmp_path / "m.gguf"


def _truncate(file, n=100):
    os.truncate(file, file.stat().st_size - n)


BAD = {  # case -> (how to break the file, the message)
    "iq1_s": (lambda f, tmp: retype(f, tmp / "m.gguf", lambda n: T.IQ1_S if n == "blk.1.ffn_up.weight" else T.Q8_0),
              r"tensor 'blk.1.ffn_up.weight' has type IQ1_S, which draftflow does not read; expected one of F32, F16, "
              r"BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS; re-quantize"),
    "tq1_0": (lambda f, tmp: retype(f, tmp / "m.gguf", lambda n: T.TQ1_0), r"tensor 'token_embd.weight' has type TQ1_0, which draftflow does not read"),
    "unknown-id": (lambda f, tmp: (retype(f, tmp / "m.gguf", lambda n: T.Q8_0), set_type_id(tmp / "m.gguf", "output.weight", 200)),
                   r"tensor 'output.weight' has type type id 200, which draftflow does not read"),
    "truncated": (lambda f, tmp: (retype(f, tmp / "m.gguf", lambda n: T.Q4_K), _truncate(tmp / "m.gguf")),
                  r"tensor '[\w.]+' \(Q4_K, shape \[\d+, 256\]\) needs bytes \d+..\d+ but the file ends at byte \d+; "
                  r"the file is truncated or corrupt, re-download or re-convert it"),
    "block-size": (lambda f, tmp: (retype(f, tmp / "m.gguf", lambda n: T.Q8_0),
                                   set_type_id(tmp / "m.gguf", "blk.0.attn_q.weight", int(T.Q4_0))),
                   r"tensor 'blk.0.attn_q.weight' \(Q4_0, shape \[256, 256\]: 36864 bytes at 18 bytes per 32 weights\) "
                   r"is followed by 'blk.0.attn_k.weight' at data byte \d+, expected \d+: its bytes do not match the Q4_0 "
                   r"block size; the header is corrupt or the type mislabelled"),
}


@pytest.mark.parametrize("case", [*BAD, "rows"])
@pytest.mark.parametrize("command", ["check", "generate"])
def test_bad_quantized_file_is_one_line(f32_gguf, hf_dir, tmp_path, case, command):
    """Unsupported type, unknown type id, truncated data, mislabelled block size, rows not whole blocks: exit 1, one line."""
    if case == "rows":  # a 64-wide row labelled Q4_K (256-weight blocks)
        _, path = hf_dir("qwen3")
        set_type_id(_q8(path, tmp_path), "blk.0.ffn_up.weight", int(T.Q4_K))
        message = (r"tensor 'blk.0.ffn_up.weight' \(Q4_K, shape \[96, 64\]\) has rows of 64 weights, not a multiple of the "
                   r"Q4_K block of 256; expected whole blocks per row")
    else:
        make, message = BAD[case]
        make(f32_gguf, tmp_path)
    (tmp_path / "g.yaml").write_text(f"name: q\ndevice: cpu\nnodes:\n  target:\n    plugin: target\n    params:\n"
                                     f"      path: {tmp_path / 'm.gguf'}\n  verify:\n    plugin: verifier\n")
    args = ["check", tmp_path / "g.yaml"] if command == "check" else [
        "generate", "--target", tmp_path / "m.gguf", "--prompt-ids", "1,2", "--json"]
    r = run_cli(args, cwd=tmp_path, env=ENV)
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"m\.gguf: " + message, r.stderr), r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") <= 2, r.stderr


def test_gpu_warning_says_what_dequantizing_costs(f32_gguf, tmp_path):
    """A CUDA load with `quantized: false` (the default) says once, at info level, what dequantizing costs: the
    quantized types, file bytes vs device bytes, and why."""
    from structlog.testing import capture_logs

    from draftflow.plugins.target.gguf_loader import _warn_dequantized

    retype(f32_gguf, tmp_path / "q.gguf", _mixed)
    with capture_logs() as logs:
        _warn_dequantized(gguf.GGUFReader(tmp_path / "q.gguf").tensors, [], torch.bfloat16, "q.gguf", keep=False)
    assert len(logs) == 1 and logs[0]["log_level"] == "info"
    assert re.fullmatch(r"q\.gguf: Q4_0, Q4_K, Q5_K, Q6_K, Q8_0 weights are dequantized at load: 639\.12 KiB in the "
                        r"file take 1\.81 MiB of bfloat16 on the GPU; the target's `quantized: false` \(the default, "
                        r"faster today\) asks for that; true "
                        r"keeps Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K projections quantized", logs[0]["event"]), logs[0]["event"]
