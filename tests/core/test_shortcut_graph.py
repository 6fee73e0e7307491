"""`generate --target T --<drafter>` graphs: core asks the plugins (draftflow_target_params), it imports none."""

from __future__ import annotations

import types

import pytest

from draftflow.core.errors import PluginError, SpecError
from draftflow.core.registry import load_registry
from draftflow.core.session import shortcut_graph
from draftflow.plugin import hookimpl
from helpers import ROOT

DEMO = ROOT / "graphs" / "models" / "demo"


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
