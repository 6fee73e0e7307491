"""The `target` node through its public entry points: YAML graphs, the executor and the CLI."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import ROOT, run_cli
from numerics import assert_close_to_scale, tiny_model_bound

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import GraphSpec

PROMPT = [3, 14, 15, 92, 65]


def hf_greedy(model, prompt, n):
    """transformers' own greedy loop with its cache (the independent reference)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def run_graph(path, kv_mode="static", n=32, taps=(), num_draft=4):
    registry = load_registry(autoload=False)
    spec = GraphSpec.from_dict({"num_draft": num_draft, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(path), "kv_mode": kv_mode, "tap_layers": list(taps), "grow_chunk": 16}},
        "verify": {"plugin": "verifier"}}})
    plan = build_plan(spec, registry)
    plan.raise_if_problems()
    ex = Executor(plan, hook=registry.pm.hook)
    return ex, ex.generate(PROMPT, SamplingParams(max_new_tokens=n, ignore_eos=True))


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("kv_mode", ["static", "grow"])
def test_graph_decoding_equals_transformers_greedy(hf_dir, arch, kv_mode):
    """Target-only decoding through a YAML-shaped graph equals transformers' greedy output, in both KV modes."""
    model, path = hf_dir(arch)
    _, result = run_graph(path, kv_mode, n=48)
    assert list(result.token_ids) == hf_greedy(model, PROMPT, 48)


def test_a_cpu_target_runs_fused_projections_through_the_cpu_linear_rule(hf_dir, monkeypatch):
    """On the CPU the node fuses each layer's q/k/v and gate/up weights (one product each, as the CUDA graphs run)
    and every projection goes through `cpu_linear.linear` (oneDNN for windows), not nn.Linear's MKL product; the
    output still equals transformers' greedy run."""
    from draftflow.layers import cpu_linear, fused
    from draftflow.layers.fused import joined

    model, path = hf_dir("qwen3")
    widths = []
    real = cpu_linear.linear
    recorded = lambda x, w, b=None: widths.append(w.shape[0]) or real(x, w, b)  # noqa: E731
    monkeypatch.setattr(cpu_linear, "linear", recorded)  # projections (o_proj, down_proj, unfused ones)
    monkeypatch.setattr(fused.PLAIN, "matmul", recorded)  # fused products
    ex, result = run_graph(path, n=16)
    layer = ex.nodes["target"].model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert joined([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is not None
    assert joined([mlp.gate_proj.weight, mlp.up_proj.weight]) is not None
    assert 2 * mlp.gate_proj.out_features in widths  # gate/up: one product
    assert sum(lin.out_features for lin in (attn.q_proj, attn.k_proj, attn.v_proj)) in widths
    assert list(result.token_ids) == hf_greedy(model, PROMPT, 16)


def test_manifest_declares_kv_features_and_weights(hf_dir):
    """The plan counts weights from shapes, sizes the KV buffer, and provides target.features with taps."""
    _, path = hf_dir("qwen3")
    registry = load_registry(autoload=False)
    spec = GraphSpec.from_dict({"vram_budget": "64MiB", "nodes": {
        "target": {"plugin": "target", "params": {"path": str(path), "tap_layers": [0, 1]}}, "verify": {"plugin": "verifier"}}})
    plan = build_plan(spec, registry)
    assert plan.problems == []
    m = plan.nodes["target"].manifest
    assert {"target.features", "kv.static", "target.logits"} <= m.provides
    row = next(r for r in plan.vram.rows if r.node == "target")
    assert row.weights == sum(p.numel() * 4 for p in _params(path))
    assert plan.vram.kv_tokens == 256  # the model's context limit caps the autosized cache
    assert plan.buffers["kv_cache"].nbytes == 2 * 2 * 2 * 16 * 4 * (256 + 5)  # + one window (num_draft 4 + 1) of slack


def _params(path):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return [f.get_tensor(k) for k in f.keys()]


def test_features_carried_after_commit(hf_dir):
    """With tap_layers, commits carry the taps of the anchor and accepted rows, equal to a fresh forward."""
    model, path = hf_dir("qwen3")
    ex, result = run_graph(path, taps=(0, 1), n=8)
    tokens = PROMPT + list(result.token_ids)
    feats = ex.nodes["target"].features[:, :len(tokens) - 1]
    with torch.no_grad():
        hs = model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    ref = torch.cat([hs[1], hs[2]], dim=-1)
    assert_close_to_scale(feats, ref, tiny_model_bound(2), "carried taps")


def test_cli_generate_json_contract(hf_dir, tmp_path):
    """`draftflow generate --target DIR --prompt-ids ... --json` follows the output contract."""
    model, path = hf_dir("llama")
    r = run_cli(["generate", "--target", path, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "20",
                 "--json", "--ignore-eos"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == hf_greedy(model, PROMPT, 20)
    assert out["prompt_token_ids"] == PROMPT and out["text"] is None and out["finish_reason"] == "length"
    assert out["stats"]["cycles"] == 20 and out["stats"]["tau"] == 1.0


def test_cli_default_graph_with_text_prompt(tmp_path):
    """The shipped default graph runs from any directory with a text prompt and decodes text."""
    r = run_cli(["generate", "def fib(n):", "--max-new-tokens", "8", "--json"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert isinstance(out["text"], str) and len(out["token_ids"]) == 8 and out["prompt_token_ids"]


@pytest.mark.parametrize("args, message", [
    (["--target", "/no/such/model"], "no such model directory or file"),
    (["--target", "{tmp}"], "config.json"),
    (["--prompt-ids", "1,99999"], "outside the vocabulary"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "5000"], "exceeds the context"),
    (["--prompt-ids", "1,2", "--device", "tpu"], "device 'tpu' is not"),
    (["--prompt-ids", "1,2", "--set", "nodes.target.tap_layers=[7]"], "tap_layers [7] are outside"),
])
def test_bad_input_is_one_line(tmp_path, args, message):
    """Missing model, missing config, bad ids, prompt past context, unknown device: one line, exit 1."""
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--target" not in args:
        args = ["--graph", ROOT / "graphs" / "default.yaml", *args]
    else:
        args = [*args, "--prompt-ids", "1,2"]
    r = run_cli(["generate", *args], cwd=tmp_path, env={**os.environ, "DRAFTFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert r.returncode == 1, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr and r.stderr.count("\n") <= 2, r.stderr
