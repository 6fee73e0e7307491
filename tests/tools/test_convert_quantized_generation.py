"""Quantized GGUF files written by convert_gguf load back in draftflow and generate like the float model, within the type's error."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ROOT, SMALL_PAIR

from draftflow.core.cli import main as draftflow
from draftflow.layers.kv_cache import KVCache
from draftflow.plugins.target.gguf_loader import load_gguf
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.tools import convert_dflash, convert_gguf

DEMO = SMALL_PAIR
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fib"
# Relative logit error (Frobenius) against the float model on PROMPT, measured 0.0075 / 0.020 / 0.026 / 0.034 /
# 0.048 on the demo target; the bounds leave ~1.5x headroom. Listed from most to fewest bits per weight.
BOUNDS = {"q8_0": 0.012, "q5_1": 0.03, "q5_0": 0.04, "q4_1": 0.05, "q4_0": 0.072}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The demo target at every quantized --outtype, and the demo DFlash drafter as a llama.cpp-ready GGUF."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for outtype in BOUNDS:
        out[outtype] = root / f"target-{outtype}.gguf"
        assert convert_gguf.main([str(DEMO / "target"), str(out[outtype]), "--outtype", outtype]) == 0
    out["drafter"] = root / "dflash.gguf"
    assert convert_dflash.main([str(DEMO / "dflash"), str(out["drafter"]), "--target", str(out["q8_0"])]) == 0
    return out


def _generate(capsys, *args: str) -> list[int]:
    capsys.readouterr()
    assert draftflow(["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "32", "--ignore-eos", "--json",
                      *args]) == 0
    return json.loads(capsys.readouterr().out)["token_ids"]


def _logits(path) -> torch.Tensor:
    loaded = load_gguf(path, "cpu", torch.float32) if str(path).endswith(".gguf") else load_hf(path, "cpu", torch.float32)
    ids = torch.tensor([loaded.tokenizer.encode(PROMPT).ids])  # [1, T]
    return loaded.model(ids, 0, KVCache.growing(loaded.config, 1, 64, torch.float32, "cpu"))[0]  # [1, T, V]


def test_q8_0_target_generates_the_float_tokens_with_and_without_the_drafter(files, capsys):
    """`draftflow generate` on the Q8_0 file gives the float model's 32 greedy tokens; the --target drafter GGUF keeps them."""
    want = _generate(capsys, "--target", str(DEMO / "target"))
    assert _generate(capsys, "--target", str(files["q8_0"])) == want
    assert _generate(capsys, "--target", str(files["q8_0"]), "--dflash", str(files["drafter"])) == want


def test_each_type_stays_within_its_quantization_error(files):
    """Logits of every quantized file are within the type's bound of the float logits, and fewer bits err more."""
    ref = _logits(DEMO / "target")
    errors = {t: ((_logits(files[t]) - ref).norm() / ref.norm()).item() for t in BOUNDS}
    for outtype, bound in BOUNDS.items():
        assert 0 < errors[outtype] < bound, (outtype, errors)
    assert list(errors.values()) == sorted(errors.values()), errors
