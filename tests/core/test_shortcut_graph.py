"""`generate --target T --<drafter>` graphs: core asks the plugins (draftflow_target_params,
draftflow_shortcut_defaults), it imports none."""

from __future__ import annotations

import json
import types

import pytest

from draftflow.core.errors import PluginError, SpecError
from draftflow.core.registry import load_registry
from draftflow.core.session import Session, shortcut_graph
from draftflow.plugin import hookimpl
from helpers import ROOT, run_cli, SMALL_PAIR

DEMO = SMALL_PAIR


def _args(**kw):
    base = dict(target=str(DEMO / "target"), dflash=None, dflash2=None, mtp=None, lookup=False)
    return types.SimpleNamespace(**{**base, **kw})


def _plugin(answer):
    """A plugin answering for prompt-lookup nodes (and recording what it was asked)."""
    asked = []

    @hookimpl
    def draftflow_target_params(plugin, params, target):
        asked.append((plugin, params, target))
        if plugin != "prompt-lookup":
            return None
        if isinstance(answer, Exception):
            raise answer
        return answer

    return types.SimpleNamespace(draftflow_target_params=draftflow_target_params), asked


def test_drafter_answers_are_merged_into_the_target_params():
    """DFlash answers its trained taps, MTP the last layer; lists are unioned in node order, without repeats."""
    registry = load_registry(autoload=False)
    assert shortcut_graph(_args(mtp=""), registry)["nodes"]["target"]["params"]["tap_layers"] == [3]
    assert shortcut_graph(_args(dflash=str(DEMO / "dflash"), mtp=""), registry)["nodes"]["target"]["params"]["tap_layers"] == [1, 2, 3]
    plugin, _ = _plugin({"tap_layers": [3, 0]})
    registry = load_registry(autoload=False, extra_plugins=(("answers", plugin),))
    graph = shortcut_graph(_args(lookup=True, dflash=str(DEMO / "dflash")), registry)
    assert graph["nodes"]["target"]["params"]["tap_layers"] == [3, 0, 1, 2]  # lookup's node comes before dflash's


def test_a_third_party_plugin_is_asked_with_the_target_info():
    """Every plugin is asked for every drafter node, with the target's TargetInfo; its answer lands in the target params."""
    plugin, asked = _plugin({"tap_layers": [0], "prefill_chunk": 64})
    registry = load_registry(autoload=False, extra_plugins=(("answers", plugin),))
    graph = shortcut_graph(_args(lookup=True), registry)
    assert graph["nodes"]["target"]["params"] == {"path": str(DEMO / "target"), "tap_layers": [0], "prefill_chunk": 64}
    (name, params, info), = asked
    assert name == "prompt-lookup" and params == {} and info.num_layers == 4 and info.vocab_size == 2048


def test_unreadable_target_is_passed_as_none_and_a_user_error_is_left_to_check():
    """A target that cannot be read gives target=None; a DraftflowError in a plugin's answer is dropped."""
    plugin, asked = _plugin(SpecError("no such file"))
    registry = load_registry(autoload=False, extra_plugins=(("answers", plugin),))
    graph = shortcut_graph(_args(target="/nonexistent", lookup=True), registry)
    assert graph["nodes"]["target"]["params"] == {"path": "/nonexistent"} and asked[0][2] is None


def test_a_plugin_bug_in_the_hook_is_a_plugin_error():
    """A plugin that crashes or answers a non-dict is named as a plugin problem, not a traceback."""
    for answer, text in ((KeyError("x"), "KeyError"), ([1, 2], "list, not a dict")):
        plugin, _ = _plugin(answer)
        registry = load_registry(autoload=False, extra_plugins=(("answers", plugin),))
        with pytest.raises(PluginError, match=text):
            shortcut_graph(_args(lookup=True), registry)


def _block(path) -> int:
    from draftflow.plugins.dflash.loader import read_config

    return read_config(path).block_size


def test_dflash_shortcuts_draft_the_trained_block():
    """--dflash and --dflash2 default num_draft to block_size - 1; a mixer with lookup keeps the largest answer."""
    registry = load_registry(autoload=False)
    dflash, dflash2 = DEMO / "dflash", DEMO / "dflash2"
    from draftflow.plugins.dflash.dflash2_loader import read_config as read_config2

    assert shortcut_graph(_args(dflash=str(dflash)), registry)["num_draft"] == _block(dflash) - 1
    assert shortcut_graph(_args(dflash2=str(dflash2)), registry)["num_draft"] == read_config2(dflash2).base.block_size - 1
    assert shortcut_graph(_args(dflash=str(dflash), lookup=True), registry)["num_draft"] == _block(dflash) - 1
    assert "num_draft" not in shortcut_graph(_args(lookup=True), registry)  # no answer: the graph default (4)
    plugin = types.SimpleNamespace(draftflow_shortcut_defaults=hookimpl(
        lambda plugin, params: {"num_draft": 40} if plugin == "prompt-lookup" else None))
    registry = load_registry(autoload=False, extra_plugins=(("answers", plugin),))
    assert shortcut_graph(_args(dflash=str(dflash), lookup=True), registry)["num_draft"] == 40


def test_spec_overrides_the_drafters_default():
    """`--spec K` (the num_draft=K override the CLI adds) beats the drafter's default; without it the default holds."""
    registry = load_registry(autoload=False)
    graph = shortcut_graph(_args(dflash=str(DEMO / "dflash")), registry)
    assert Session.load_spec(graph_dict=graph).num_draft == _block(DEMO / "dflash") - 1
    assert Session.load_spec(graph_dict=graph, overrides=["num_draft=3"]).num_draft == 3


def test_a_bad_shortcut_default_is_a_plugin_error():
    """A non-dict, an unknown key or a non-integer value from draftflow_shortcut_defaults names the plugin problem."""
    for answer, text in (([15], "list, not a dict"), ({"device": 1}, "device=1"), ({"num_draft": "8"}, "num_draft='8'")):
        plugin = types.SimpleNamespace(draftflow_shortcut_defaults=hookimpl(
            lambda plugin, params, answer=answer: answer if plugin == "prompt-lookup" else None))
        registry = load_registry(autoload=False, extra_plugins=(("answers", plugin),))
        with pytest.raises(PluginError, match=text):
            shortcut_graph(_args(lookup=True), registry)


def test_generate_with_dflash_drafts_block_size_minus_one(tmp_path):
    """`generate --target T --dflash D` drafts block_size - 1 tokens in its first cycle (trace) and per-position stats."""
    k = _block(DEMO / "dflash") - 1
    trace = tmp_path / "trace.jsonl"
    out = run_cli(["generate", "--target", DEMO / "target", "--dflash", DEMO / "dflash", "--prompt", "def add(a, b):",
                   "--max-new-tokens", 4 * k, "--json", "--trace", trace])
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)["stats"]
    first = json.loads(trace.read_text().splitlines()[0])
    assert first["event"] == "draft_cycle" and len(first["draft"]) == k
    assert len(stats["per_position_acceptance"]) == k
