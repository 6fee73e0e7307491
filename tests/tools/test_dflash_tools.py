"""`python -m draftflow.tools.dflash_taps` and `dflash_stage_parity` on the shipped demo pair, through their CLIs.

Fault-injection cases call the same `main(argv)` in-process so a bug can be planted with
monkeypatch; everything else runs the module as a user would.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from helpers import ROOT, SMALL_PAIR

from draftflow.plugins.dflash.loader import read_config

DEMO = SMALL_PAIR
TARGET, DFLASH = DEMO / "target", DEMO / "dflash"
PROMPT = "def add(a, b):\n    return"


def _tool(name: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"draftflow.tools.{name}", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def _variant(tmp_path, name: str, **config) -> str:
    """A copy of the demo DFlash drafter whose config.json has `config` merged in (same weights)."""
    out = tmp_path / name
    out.mkdir()
    (out / "model.safetensors").symlink_to(DFLASH / "model.safetensors")
    base = json.loads((DFLASH / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**base, **config}))
    return str(out)


def _one_error_line(out: subprocess.CompletedProcess, pattern: str) -> None:
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert re.match(r"error: " + pattern, out.stderr), out.stderr


def test_taps_from_verify_windows_equal_prefill_taps():
    """Every tap layer gets a prefill row and per-cycle rows, all within tolerance; exit 0."""
    out = _tool("dflash_taps", TARGET, DFLASH, "--prompt", PROMPT, "--new", 20)
    assert out.returncode == 0, out.stderr
    taps = read_config(DFLASH).target_layer_ids
    for layer in taps:
        assert re.search(rf"^\s+{layer}\s+prefill\s+0\.\.", out.stdout, re.M), out.stdout
        assert re.search(rf"^\s+{layer}\s+cycle 0\s+", out.stdout, re.M), out.stdout
    assert f"K = {read_config(DFLASH).block_size - 1}" in out.stdout
    assert "differs" not in out.stdout and out.stdout.rstrip().endswith("x max |tap|)")


def test_taps_tool_reports_a_verify_window_bug(monkeypatch, capsys):
    """A verify window that writes a wrong tap row is caught: one error line naming the layer and the cycle; exit 1."""
    from draftflow.plugins.target.plugin import Target
    from draftflow.tools.dflash_taps import main

    real_step = Target.step

    def step(self, batch, inputs):
        out = real_step(self, batch, inputs)
        for _, req in batch.active():
            if self.features is not None and req.position > 0:
                self.features[req.slot, req.position] *= 1.01  # the anchor row's taps, off by 1%
        return out

    monkeypatch.setattr(Target, "step", step)
    assert main([str(TARGET), str(DFLASH), "--prompt", PROMPT, "--new", "8"]) == 1
    captured = capsys.readouterr()
    first = read_config(DFLASH).target_layer_ids[0]
    assert re.search(rf"^\s+{first}\s+prefill .*\d$", captured.out, re.M)  # the prompt rows are untouched
    assert re.fullmatch(rf"error: verify-window taps differ from prefill taps: layer {first}, cycle 0 .*\n", captured.err)


def test_stage_parity_agrees_with_numpy_on_the_demo_drafter():
    """Every stage of every layer, context and block rows, agrees with the NumPy implementation to 1e-4; exit 0."""
    out = _tool("dflash_stage_parity", TARGET, DFLASH)
    assert out.returncode == 0, out.stderr
    layers = read_config(DFLASH).num_layers
    for stage in ("input_norm", "q_proj", "k_proj (context)", "q_norm", "k_norm (block)", "rope q", "rope k (context)",
                  "attention", "o_proj", "post_norm", "mlp"):
        assert len(re.findall(rf"^\s+\d+\s+{re.escape(stage)}\s\s", out.stdout, re.M)) == layers, stage
    assert re.search(r"^\s+-\s+final norm\s", out.stdout, re.M) and re.search(r"^\s+-\s+logits\s", out.stdout, re.M)
    agree = re.search(r"all stages agree to (\S+) \(relative", out.stdout)
    assert agree and float(agree[1]) < 1e-4


@pytest.mark.parametrize("config", [
    {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},  # causal sliding + full
    {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 4, "is_causal": False},
    {"is_causal": True},
], ids=["sliding", "non-causal-sliding", "causal"])
def test_stage_parity_covers_the_layer_kinds(tmp_path, capsys, config):
    """Sliding-window and causal layer kinds use their masks on both sides and agree."""
    from draftflow.tools.dflash_stage_parity import main

    assert main([str(TARGET), _variant(tmp_path, "d", **config)]) == 0, capsys.readouterr().err
    assert "all stages agree to" in capsys.readouterr().out


def test_stage_parity_names_the_first_divergence(tmp_path, monkeypatch, capsys):
    """A model that drops its sliding-window mask diverges first at layer 0's attention; later stages are not blamed."""
    from draftflow.plugins.dflash.model import DFlashModel
    from draftflow.tools.dflash_stage_parity import main

    real = DFlashModel.cache_window

    def unmasked(self, *args, **kw):
        window = real(self, *args, **kw)
        return window._replace(masks=[None] * len(window.masks))

    monkeypatch.setattr(DFlashModel, "cache_window", unmasked)
    drafter = _variant(tmp_path, "d", layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    assert main([str(TARGET), drafter]) == 1
    captured = capsys.readouterr()
    assert re.fullmatch(r"error: first divergence at stage 'attention', layer 0, row \d+: max abs diff .*\n", captured.err)
    assert captured.out.count("<- first divergence") == 1


@pytest.mark.parametrize("tool", ["dflash_taps", "dflash_stage_parity"])
def test_bad_input_is_one_error_line(tool, tmp_path):
    """A missing target or drafter, or a drafter that is not DFlash (the demo MTP head): one `error:` line, exit 1."""
    _one_error_line(_tool(tool, tmp_path / "nope", DFLASH, "--prompt", PROMPT), r"TARGET .*nope: no such directory")
    _one_error_line(_tool(tool, TARGET, tmp_path / "nope", "--prompt", PROMPT), r"DRAFTER .*nope: no such directory")
    _one_error_line(_tool(tool, TARGET, DEMO / "mtp", "--prompt", PROMPT), r"DRAFTER .*mtp is not a DFlash")


def test_stage_parity_refuses_what_its_reference_does_not_implement(tmp_path):
    """A DFlash2 drafter and a RoPE-scaled config are refused with one line saying why."""
    _one_error_line(_tool("dflash_stage_parity", TARGET, DEMO / "dflash2"), r"DRAFTER .*dflash2 is a DFlash2 artifact")
    scaled = _variant(tmp_path, "scaled", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    _one_error_line(_tool("dflash_stage_parity", TARGET, scaled), r"DRAFTER .*: RoPE scaling \(llama3\)")

