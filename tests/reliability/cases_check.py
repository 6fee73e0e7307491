"""Bad check inputs: broken model files, drafters paired with the wrong target, bad node params.

A check report lists every problem (a heading and one line per problem), so its cases
set ``lines``; everything else is one `error: ...` line.
"""

import json
import os

from harness import DEMO, GRAPHS, Case, copy_demo

TINY = GRAPHS / "models" / "tiny-qwen3"
TARGET_ONLY = "nodes:\n  target: {plugin: target, params: {path: target}}\n  verify: {plugin: verifier}\n"
DEMO_GRAPH = "{demo}/demo.yaml"


def _graph(target="target", taps=(), drafter=None, extra=""):
    """A graph file's text: a target, optionally a drafter node of plugin:path, a verifier."""
    lines = ["nodes:", f"  target: {{plugin: target, params: {{path: {target}, tap_layers: {list(taps)}}}}}"]
    if drafter:
        plugin, path = drafter
        lines.append(f"  drafter: {{plugin: {plugin}, params: {{path: {path}}}}}")
        if plugin == "dflash2":
            lines.append("  selector: {plugin: dflash2-selector}")
    lines.append("  verify: {plugin: verifier}")
    return "\n".join(lines) + "\n" + extra


def _with_config(name="target", raw=None, **changes):
    """Setup: a copy of demo model NAME whose config.json gets `changes` (None deletes a key) or is `raw` text."""

    def setup(tmp):
        dest = copy_demo(tmp, name)
        file = dest / "config.json"
        if raw is not None:
            file.write_text(raw)
            return
        cfg = json.loads(file.read_text())
        for key, value in changes.items():
            if value is None:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        file.write_text(json.dumps(cfg))

    return setup


def _replace(name, file, how):
    """Setup: a copy of demo model NAME whose FILE is replaced by a directory or a dangling symlink."""

    def setup(tmp):
        path = copy_demo(tmp, name) / file
        path.unlink()
        if how == "dir":
            path.mkdir()
        else:
            os.symlink(tmp / "nowhere", path)

    return setup


def _nan_weights(tmp):
    """A copy of the demo target whose every weight is NaN (a corrupt checkpoint that still parses)."""
    from safetensors.torch import load_file, save_file

    file = copy_demo(tmp) / "model.safetensors"
    save_file({k: v.fill_(float("nan")) for k, v in load_file(file).items()}, file)


def _many_bad_edges(tmp):
    lines = ["nodes:", "  target: {plugin: toy-target}", "  drafter: {plugin: toy-drafter}", "  verify: {plugin: verifier}",
             "edges:"]
    lines += [f"  - ghost{i}.proposal -> verify.proposal" for i in range(2000)]
    (tmp / "edges.yaml").write_text("\n".join(lines) + "\n")


def _capped(r, tmp):
    lines = r.stderr.splitlines()
    assert len(lines) == 52, len(lines)  # the heading, 50 problems, the count of the rest
    assert lines[-1].strip() == "... and 1950 more problems (fix the first ones and check again)", lines[-1]


def _absent(*texts):
    def check(r, tmp):
        for text in texts:
            assert text not in r.stderr, f"{text!r} in\n{r.stderr}"

    return check


def _named_once(source):
    def check(r, tmp):
        assert r.stderr.count(source) <= 1 and "correct the node's params" not in r.stderr, r.stderr

    return check


def _before(first, second):
    def check(r, tmp):
        assert first in r.stderr and second in r.stderr and r.stderr.index(first) < r.stderr.index(second), r.stderr
        assert "[capability]" not in r.stderr, r.stderr  # the missing features follow from the target's problem

    return check


def _cfg_case(id, message, **changes):
    return Case(id, ["check", "{tmp}/g.yaml"], message, files={"g.yaml": TARGET_ONLY}, setup=_with_config(**changes),
                lines=2)



# --- plugins that break the contract (issue 17, bad input) ------------------------------------------------
LEAKY_PLUGIN = """\
import torch
from draftflow.core.node import Node
from draftflow.plugin import Manifest, NodeType, Port, Proposal, hookimpl


class Leaky(Node):
    def step(self, batch, inputs):
        return {"proposal": Proposal(torch.zeros(batch.size, batch.num_draft, dtype=torch.long))}


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(name="leaky", role="drafter", factory=Leaky,
                                    manifest=lambda params, env: Manifest(role="drafter", outputs=(Port("proposal", "proposal"),))))
"""
TOY_DRAFTER = "nodes:\n{target}  d: {{plugin: toy-drafter, params: {params}}}\n  verify: {{plugin: verifier}}\n"
TOY_TARGET = "  target: {plugin: toy-target}\n"


def _toy_graph(params: str, target: str = TOY_TARGET) -> dict:
    return {"g.yaml": TOY_DRAFTER.format(target=target, params=params)}


CASES = [
    Case("check-max-batch-zero", ["check", DEMO_GRAPH, "--set", "max_batch=0"],
         r"max_batch must be an integer from 1 to 256 or 'auto', got 0"),
    Case("check-max-batch-word", ["check", DEMO_GRAPH, "--set", "max_batch=lots"],
         r"max_batch must be an integer from 1 to 256 or 'auto', got 'lots'"),
    Case("check-policy-k-negative", ["check", DEMO_GRAPH, "--set", "nodes.policy.params.ks=[-1]"],
         r"node 'policy' \(adaptive_k\) \[param\]: parameter 'ks': an entry -1 is below the minimum 0", lines=2),
    Case("check-warmup-tokens-negative", ["check", DEMO_GRAPH, "--set", "nodes.target.warmup_tokens=-1"],
         r"parameter 'warmup_tokens': -1 is below the minimum 0", lines=2),
    # --- a report of many problems is capped ------------------------------------------------------------
    Case("check-many-bad-edges-capped", ["check", "{tmp}/edges.yaml"], r"^error: 2000 problems in .*edges\.yaml:\n",
         setup=_many_bad_edges, toy=True, lines=52, check=_capped),
    Case("check-one-problem-where-once", ["generate", "--target", "{demo}/target", "--set", "nodes.target.kv_mode=banana", "x"],
         r"parameter 'kv_mode' is 'banana'; fix: use one of: static, grow", lines=2,
         check=_named_once("<command line>")),

    # --- the target's config.json: the file and field are named, the plugin is not blamed ---------------
    _cfg_case("check-config-json-list", r"target/config\.json: holds a JSON list; expected a JSON object", raw="[1, 2]"),
    _cfg_case("check-config-not-json", r"target/config\.json: invalid JSON", raw='{"hidden_size": 12'),
    _cfg_case("check-config-empty", r"target/config\.json: invalid JSON", raw=""),
    _cfg_case("check-config-rms-norm-eps-string", r"config\.json: field 'rms_norm_eps' is 'x'; expected a positive number",
              rms_norm_eps="x"),
    _cfg_case("check-config-rope-theta-negative", r"config\.json: field 'rope_theta' is -1; expected a positive number",
              rope_theta=-1),
    _cfg_case("check-config-hidden-negative", r"config\.json: field 'hidden_size' is -4; expected a positive integer",
              hidden_size=-4),
    _cfg_case("check-config-layers-float", r"config\.json: field 'num_hidden_layers' is 4\.5; expected a positive integer",
              num_hidden_layers=4.5),
    _cfg_case("check-config-vocab-missing", r"config\.json: field 'vocab_size' is None; expected a positive integer",
              vocab_size=None),
    _cfg_case("check-config-tie-string", r"config\.json: field 'tie_word_embeddings' is 'yes'; expected true or false",
              tie_word_embeddings="yes"),
    _cfg_case("check-config-eos-string", r"config\.json: field 'eos_token_id' is 'x'; expected a token id",
              eos_token_id="x"),
    _cfg_case("check-config-rope-scaling-string", r"config\.json: field 'rope_scaling' is 'x'; expected an object",
              rope_scaling="x"),
    _cfg_case("check-config-llama3-rope-incomplete", r"config\.json: field 'rope_scaling\.factor' is None",
              rope_scaling={"rope_type": "llama3"}),
    _cfg_case("check-config-architectures-string", r"config\.json: field 'architectures' is 'Qwen3ForCausalLM'; expected a list",
              architectures="Qwen3ForCausalLM"),
    _cfg_case("check-config-unsupported-arch", r"architecture 'GPT2LMHeadModel' is not supported",
              architectures=["GPT2LMHeadModel"]),
    _cfg_case("check-config-gqa-ratio", r"num_attention_heads=4 is not a multiple of num_key_value_heads=3",
              num_key_value_heads=3),
    Case("check-config-missing", ["check", "{tmp}/g.yaml"], r"target/config\.json: file is missing", files={"g.yaml": TARGET_ONLY},
         setup=lambda tmp: (copy_demo(tmp) / "config.json").unlink(), lines=2),
    Case("check-model-path-missing", ["check", "{tmp}/g.yaml"], r"no such model directory or file",
         files={"g.yaml": TARGET_ONLY}, lines=2),

    # --- drafter configs --------------------------------------------------------------------------------
    Case("check-dflash-config-list", ["check", "{tmp}/g.yaml"], r"dflash/config\.json: holds a JSON list",
         files={"g.yaml": _graph("{demo}/target", (1, 2, 3), ("dflash", "dflash"))}, setup=_with_config("dflash", raw="[]"),
         lines=None, check=_absent("report this to the author")),
    Case("check-dflash-block-size-string", ["check", "{tmp}/g.yaml"], r"dflash/config\.json: field 'block_size' is '8'",
         files={"g.yaml": _graph("{demo}/target", (1, 2, 3), ("dflash", "dflash"))}, setup=_with_config("dflash", block_size="8"),
         lines=None, check=_absent("report this to the author")),
    Case("check-dflash-tap-ids-string", ["check", "{tmp}/g.yaml"], r"target_layer_ids is '1,2,3'; expected a list",
         files={"g.yaml": _graph("{demo}/target", (1, 2, 3), ("dflash", "dflash"))},
         setup=_with_config("dflash", dflash_config={"mask_token_id": 2047, "target_layer_ids": "1,2,3"}),
         lines=None, check=_absent("report this to the author")),
    Case("check-dflash2-extra-config-list", ["check", "{tmp}/g.yaml"], r"dflash2/config\.json: field 'dflash_config' is \[\]",
         files={"g.yaml": _graph("{demo}/target", (1, 2, 3), ("dflash2", "dflash2"))}, setup=_with_config("dflash2", dflash_config=[]),
         lines=None, check=_absent("report this to the author")),

    # --- a drafter trained for another target -----------------------------------------------------------
    Case("check-dflash-wrong-target", ["check", "{tmp}/g.yaml"],
         r"\[wrong-target\]: drafter 'drafter' was trained for a target with hidden 128, vocab 2048, 4 layers; target 'target' "
         r"\(.*tiny-qwen3\) has hidden 64, vocab 512, 2 layers; fix: use a drafter trained for this target \(draftflow train dflash --target",
         files={"g.yaml": _graph(str(TINY), (1, 2, 3), ("dflash", str(DEMO / "dflash")))}, lines=3,
         check=_before("[wrong-target]", "tap_layers [2, 3] are outside")),
    Case("check-dflash2-wrong-target", ["check", "{tmp}/g.yaml"],
         r"\[wrong-target\]: drafter 'drafter' was trained for a target with hidden 128, vocab 2048, 4 layers",
         files={"g.yaml": _graph(str(TINY), (1,), ("dflash2", str(DEMO / "dflash2")))}, lines=None,
         check=_absent("[capability]")),
    Case("check-mtp-wrong-target", ["check", "{tmp}/g.yaml"],
         r"\[wrong-target\]: drafter 'drafter' was trained for a target with hidden 128, vocab 2048, 4 layers; target 'target' "
         r"\(.*tiny-qwen3\) has hidden 64, vocab 512, 2 layers",
         files={"g.yaml": _graph(str(TINY), (1,), ("mtp", str(DEMO / "mtp")))}, lines=2),
    Case("check-dflash-wrong-target-shortcut", ["generate", "--target", str(TINY), "--dflash", "{demo}/dflash", "x"],
         r"\[wrong-target\]: drafter 'dflash' was trained for a target with hidden 128", lines=3,
         check=_before("[wrong-target]", "tap_layers [2, 3] are outside")),
    Case("check-dflash-target-changed-copy", ["check", "{tmp}/g.yaml"],
         r"\[wrong-target\]: .* with hidden 128, vocab 2048, 4 layers; target 'target' \(.*\) has hidden 128, vocab 4096, 4 layers",
         files={"g.yaml": _graph("target", (1, 2, 3), ("dflash", str(DEMO / "dflash")))}, setup=_with_config(vocab_size=4096),
         lines=2),

    # --- a node's own param problem comes without its knock-on problems ---------------------------------
    Case("check-kv-mode-banana-alone", ["check", DEMO_GRAPH, "--set", "nodes.target.kv_mode=banana"],
         r"parameter 'kv_mode' is 'banana'; fix: use one of: static, grow", lines=2, check=_absent("[capability]")),
    Case("check-tap-layers-outside-alone", ["check", DEMO_GRAPH, "--set", "nodes.target.tap_layers=[1, 2, 7]"],
         r"tap_layers \[7\] are outside the model's layers \[0, 4\)", lines=2,
         check=_absent("[capability]", "correct the node's params")),
    Case("check-target-path-missing-alone", ["check", DEMO_GRAPH, "--set", "nodes.target.path={tmp}/none"],
         r"none: no such model directory or file", lines=2, check=_absent("[capability]")),

    # --- params: minimums, types, unknown names, choices ------------------------------------------------
    Case("check-prefill-chunk-zero", ["check", DEMO_GRAPH, "--set", "nodes.target.prefill_chunk=0"],
         r"parameter 'prefill_chunk': 0 is below the minimum 1; fix: set prefill_chunk to 1 or more", lines=2),
    Case("check-prefill-chunk-zero-generate", ["generate", "--target", "{demo}/target", "--set", "nodes.target.prefill_chunk=0", "x"],
         r"parameter 'prefill_chunk': 0 is below the minimum 1", lines=2),
    Case("check-prefill-chunk-negative", ["check", DEMO_GRAPH, "--set", "nodes.target.prefill_chunk=-5"],
         r"parameter 'prefill_chunk': -5 is below the minimum 1", lines=2),
    Case("check-prefill-chunk-string", ["check", DEMO_GRAPH, "--set", "nodes.target.prefill_chunk=abc"],
         r"parameter 'prefill_chunk': expected an integer, got 'abc'", lines=2),
    Case("check-grow-chunk-zero", ["generate", "--target", "{demo}/target", "--set", "nodes.target.kv_mode=grow",
                                   "--set", "nodes.target.grow_chunk=0", "x"],
         r"parameter 'grow_chunk': 0 is below the minimum 1", lines=2),
    Case("check-tap-layer-negative", ["check", DEMO_GRAPH, "--set", "nodes.target.tap_layers=[-1, 2, 3]"],
         r"parameter 'tap_layers': an entry -1 is below the minimum 0", lines=None),
    Case("check-expert-cache-negative", ["check", DEMO_GRAPH, "--set", "nodes.target.expert_cache=-2"],
         r"parameter 'expert_cache': -2 is below the minimum 0", lines=2),
    Case("check-cuda-graphs-string", ["check", DEMO_GRAPH, "--set", "nodes.target.cuda_graphs=maybe"],
         r"parameter 'cuda_graphs': expected true or false, got 'maybe'", lines=2),
    Case("check-target-param-typo", ["check", DEMO_GRAPH, "--set", "nodes.target.prefil_chunk=64"],
         r"unknown parameter 'prefil_chunk'; fix: remove it or rename it; did you mean 'prefill_chunk'\?", lines=2),
    Case("check-linear-rollback-bad", ["check", DEMO_GRAPH, "--set", "nodes.target.linear_rollback=undo"],
         r"parameter 'linear_rollback' is 'undo'; fix: use one of: select, replay", lines=2),
    Case("check-dflash-path-number", ["check", DEMO_GRAPH, "--set", "nodes.drafter.path=7"],
         r"parameter 'path': expected a path string, got 7", lines=None),
    Case("check-verifier-mode-bad", ["check", DEMO_GRAPH, "--set", "nodes.verify.mode=random"],
         r"parameter 'mode' is 'random'; fix: use one of: auto, greedy", lines=2),
    Case("check-mtp-prefill-chunk-zero", ["check", "{graphs}/mtp-lookup-mixer.yaml", "--set", "nodes.mtp.prefill_chunk=0"],
         r"node 'mtp' \(mtp\) \[param\]: parameter 'prefill_chunk': 0 is below the minimum 1", lines=None),
    Case("check-lookup-min-ngram-zero", ["check", "{graphs}/mtp-lookup-mixer.yaml", "--set", "nodes.lookup.min_ngram=0"],
         r"parameter 'min_ngram': 0 is below the minimum 1", lines=None),
    Case("check-lookup-ngram-order", ["check", "{graphs}/mtp-lookup-mixer.yaml", "--set", "nodes.lookup.min_ngram=6"],
         r"min_ngram=6, max_ngram=5: need 1 <= min_ngram <= max_ngram", lines=None),
    Case("check-lookup-occurrence-bad", ["check", "{graphs}/mtp-lookup-mixer.yaml", "--set", "nodes.lookup.occurrence=middle"],
         r"parameter 'occurrence' is 'middle'; fix: use one of: latest, earliest", lines=None),
    Case("check-mixer-min-tokens-zero", ["check", "{graphs}/mtp-lookup-mixer.yaml", "--set", "nodes.mix.min_tokens=0"],
         r"parameter 'min_tokens': 0 is below the minimum 1", lines=None),
    Case("check-mixer-policy-bad", ["check", "{graphs}/mtp-lookup-mixer.yaml", "--set", "nodes.mix.policy=random"],
         r"parameter 'policy' is 'random'; fix: use one of: first-nonempty, longest", lines=None),
    Case("check-mtp-layout-unknown", ["check", "{graphs}/mtp-lookup-mixer.yaml", "--set", "nodes.mtp.layout=megatron"],
         r"parameter 'layout' is 'megatron'; fix: use one of: auto, deepseek-v3, qwen3-next", lines=2),
    Case("check-mtp-config-missing", ["check", "{graphs}/mtp-lookup-mixer.yaml", "--set", "nodes.mtp.config={tmp}/none.json"],
         r"none\.json: no such config directory or config\.json; point params\.config at", lines=2),
    Case("check-mtp-no-mtp-weights", ["check", "{graphs}/mtp-lookup-mixer.yaml", "--set", "nodes.mtp.path={demo}/target"],
         r"demo_small/target: no MTP weights found", lines=2),
    Case("check-dflash-cuda-graphs-int", ["check", DEMO_GRAPH, "--set", "nodes.drafter.cuda_graphs=2"],
         r"parameter 'cuda_graphs': expected true or false, got 2", lines=2),
    Case("check-dflash-is-target", ["check", DEMO_GRAPH, "--set", "nodes.drafter.path={demo}/target"],
         r"target/config\.json: target_layer_ids is absent and num_target_layers is None", lines=2),
    Case("check-target-gguf-garbage", ["check", DEMO_GRAPH, "--set", "nodes.target.path={tmp}/m.gguf"],
         r"m\.gguf: not a readable GGUF file", files={"m.gguf": b"GGUF" + bytes(range(200))}, lines=2),
    Case("check-oracle-negative-id", ["check", "{tmp}/g.yaml"], r"parameter 'reference': an entry -3 is below the minimum 0",
         files={"g.yaml": "nodes:\n  target: {plugin: target, params: {path: " + str(DEMO / "target") + "}}\n"
                          "  oracle: {plugin: oracle, params: {reference: [5, -3]}}\n  verify: {plugin: verifier}\n"},
         lines=None),

    # --- files that cannot be read ----------------------------------------------------------------------
    Case("check-config-is-directory", ["check", "{tmp}/g.yaml"], r"target/config\.json: cannot be read: a directory",
         files={"g.yaml": TARGET_ONLY}, setup=_replace("target", "config.json", "dir"), lines=2,
         check=_absent("report this to the author")),
    Case("check-config-dangling-symlink", ["check", "{tmp}/g.yaml"], r"target/config\.json: cannot be read: a broken symbolic link",
         files={"g.yaml": TARGET_ONLY}, setup=_replace("target", "config.json", "link"), lines=2),
    Case("check-safetensors-is-directory", ["generate", "--target", "{tmp}/target", "--max-new-tokens", "1", "x"],
         r"model\.safetensors: cannot be read: a directory; expected a safetensors file",
         setup=_replace("target", "model.safetensors", "dir")),
    Case("check-safetensors-dangling-symlink", ["generate", "--target", "{tmp}/target", "--max-new-tokens", "1", "x"],
         r"model\.safetensors: cannot be read: a broken symbolic link", setup=_replace("target", "model.safetensors", "link")),
    Case("check-tokenizer-is-directory", ["generate", "--target", "{tmp}/target", "--max-new-tokens", "1", "x"],
         r"tokenizer\.json: cannot be read: a directory", setup=_replace("target", "tokenizer.json", "dir")),
    Case("check-generation-config-list", ["generate", "--target", "{tmp}/target", "--max-new-tokens", "1", "x"],
         r"generation_config\.json: holds a JSON list",
         setup=lambda tmp: (copy_demo(tmp) / "generation_config.json").write_text("[0]")),
    Case("check-dflash-safetensors-is-directory", ["generate", "--target", "{demo}/target", "--dflash", "{tmp}/dflash",
                                                   "--max-new-tokens", "1", "x"],
         r"dflash/model\.safetensors: cannot be read: a directory", setup=_replace("dflash", "model.safetensors", "dir")),
    Case("check-safetensors-truncated", ["generate", "--target", "{tmp}/target", "--max-new-tokens", "1", "x"],
         r"model\.safetensors: not a readable safetensors file",
         setup=lambda tmp: (lambda f: f.write_bytes(f.read_bytes()[:1000]))(copy_demo(tmp) / "model.safetensors")),
    Case("check-nan-weights", ["generate", "--target", "{tmp}/target", "--max-new-tokens", "4", "x"],
         r"node 'target' \(target, .*target\) produced NaN or infinite logits", setup=_nan_weights),
    Case("check-mtp-weights-directory", ["check", "{tmp}/g.yaml"], r"mtp\.safetensors: cannot be read: a directory",
         files={"g.yaml": _graph(str(DEMO / "target"), (3,), ("mtp", "mtp"))}, setup=_replace("mtp", "mtp.safetensors", "dir"),
         lines=2),

    # --- plugins that break the contract: one line naming the node and the fix --------------------------
    # The plugin module lies in {tmp}, the working directory, which `python -m draftflow` puts on sys.path.
    Case("check-plugin-imports-private-module", ["check", "{tmp}/g.yaml"],
         r"node 'd' \(leaky\) \[plugin-import\]: plugin 'leaky_plugin' imports draftflow\.core\.node \(leaky_plugin\.py:2\), "
         r"private to draftflow .*; fix: import what a plugin needs from draftflow\.plugin",
         files={"leaky_plugin.py": LEAKY_PLUGIN, "g.yaml": "nodes:\n  target: {plugin: toy-target}\n  d: {plugin: leaky}\n"
                "  verify: {plugin: verifier}\n"},
         toy=True, env={"DRAFTFLOW_PLUGINS": "toy_plugins,leaky_plugin"}, lines=2),
    Case("check-needs-target-handle-no-target", ["check", "{tmp}/g.yaml"],
         r"node 'd' \(toy-drafter\) \[capability\]: needs the target's interface \('target\.handle'.*\), which only a target "
         r"node provides, and the graph has no target node; fix: add a target node, e.g\. `target: \{plugin: target",
         files=_toy_graph("{requires: [target.handle]}", target=""), toy=True, lines=None),
    Case("check-needs-target-handle-target-lacks-it", ["check", "{tmp}/g.yaml"],
         r"node 'd' \(toy-drafter\) \[capability\]: needs the target's interface \('target\.handle'.*\), which target 'target' "
         r"\(toy-target\) does not provide; fix: use a target plugin that provides 'target\.handle'",
         files=_toy_graph("{requires: [target.handle]}", target="  target: {plugin: toy-target, params: {handle: false}}\n"),
         toy=True, lines=3),  # the verifier needs the interface too
    Case("check-reads-unowned-buffer", ["check", "{tmp}/g.yaml"],
         r"node 'd' \(toy-drafter\) \[buffer-missing\]: reads buffer 'draft_cache', which no node owns; fix: add the node",
         files=_toy_graph("{reads: [draft_cache]}"), toy=True, lines=2),
    Case("check-writes-buffer-of-another-node", ["check", "{tmp}/g.yaml"],
         r"node 'd' \(toy-drafter\) \[buffer-write\]: writes buffer 'toy_kv', which is owned by 'target'; fix: only the owner",
         files=_toy_graph("{writes: [toy_kv]}"), toy=True, lines=2),
]
