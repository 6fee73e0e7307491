"""The mtp node in graphs: greedy gate, checks before allocation, load errors."""

from __future__ import annotations

import pytest

from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import GraphSpec
from draftflow.testing import greedy_gate

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [11, 200, 31]]


def mtp_graph(target, mtp_path, taps=(0,), num_draft=4, max_batch=1, **mtp_params):
    return GraphSpec.from_dict({"num_draft": num_draft, "max_batch": max_batch, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(target), "tap_layers": list(taps)}},
        "mtp": {"plugin": "mtp", "params": {"path": str(mtp_path), **mtp_params}},
        "verify": {"plugin": "verifier"}}})


@pytest.fixture(scope="module")
def registry():
    """The installed plugins (built-ins only)."""
    return load_registry()


@pytest.mark.parametrize("layout", ["deepseek-v3", "qwen3-next"])
def test_greedy_gate_with_mtp_drafts(mimic_dirs, registry, layout):
    """MTP drafts leave greedy output identical to target-only decoding, and many are accepted."""
    target, mtp_dir = mimic_dirs(layout)
    report = greedy_gate(mtp_graph(target, mtp_dir), PROMPTS, max_new_tokens=40, registry=registry)
    assert report.drafted > 0
    assert report.accepted > report.drafted // 2, (report.accepted, report.drafted)


def test_one_token_prompt_decodes_losslessly_and_drafts_later(mimic_dirs, registry):
    """A one-token prompt (no (token, hidden) pair in cycle 0) stays lossless, and later cycles' drafts are accepted."""
    target, mtp_dir = mimic_dirs("deepseek-v3")
    report = greedy_gate(mtp_graph(target, mtp_dir), [[42]], max_new_tokens=12, registry=registry)
    assert report.accepted > 0


def test_check_asks_for_the_last_layer_tap(mimic_dirs, registry):
    """Without the target's last layer among tap_layers the check names the fix."""
    target, mtp_dir = mimic_dirs("qwen3-next")
    plan = build_plan(mtp_graph(target, mtp_dir, taps=()), registry)
    found = [p.render() for p in plan.problems]
    assert any("[mtp-hidden]" in p and "lacks the last layer 0" in p and "fix: set nodes.target.tap_layers=[0]" in p
               for p in found), found


def test_missing_mtp_weights_is_a_clear_check_error(mimic_dirs, registry):
    """A checkpoint without MTP tensors is reported before allocation, naming both layouts."""
    target, _ = mimic_dirs("deepseek-v3")
    plan = build_plan(mtp_graph(target, target), registry)
    found = [p.render() for p in plan.problems]
    assert any("node 'mtp' (mtp) [manifest]" in p and "no MTP weights found" in p and "'model.layers.1.eh_proj.weight'" in p
               and "'mtp.fc.weight'" in p for p in found), found


def test_mtp_declares_its_own_kv_buffer(mimic_dirs, registry):
    """The MTP KV cache is an owned buffer of one row per request slot, kv_tokens + K + 1 cells each, planned with the target's."""
    target, mtp_dir = mimic_dirs("deepseek-v3")
    plan = build_plan(mtp_graph(target, mtp_dir, max_batch=3), registry)
    assert plan.problems == []
    (buf,) = plan.nodes["mtp"].manifest.owns
    assert buf.name == "mtp_kv" and buf.shape[2:4] == ("batch", "kv_tokens+5")
    assert plan.buffers["mtp_kv"].nbytes == 3 * 2 * 2 * 16 * (plan.vram.kv_tokens + 5) * 4


def test_target_params_hook_asks_for_the_last_layer(registry):
    """draftflow_target_params: an mtp node asks the target to tap its last layer (none when the target is unknown)."""
    from draftflow.plugin import TargetInfo

    hook = registry.pm.hook.draftflow_target_params
    info = TargetInfo(hidden_size=64, vocab_size=320, num_layers=36)
    assert hook(plugin="mtp", params={"path": "unused"}, target=info) == [{"tap_layers": [35]}]
    assert hook(plugin="mtp", params={"path": "unused"}, target=None) == []
