"""Plugin loading: entry points, autoload switch, hook validation, broken plugins."""

from __future__ import annotations

import types

import pytest

from draftflow.core.errors import PluginError
from draftflow.core.hookspecs import hookimpl
from draftflow.core.manifest import Manifest
from draftflow.core.plan import build_plan
from draftflow.core.registry import NodeType, load_registry
from draftflow.core.spec import graph_from_text


def test_builtins_register_through_entry_points():
    """Built-in nodes come from the 'draftflow' entry-point group, even with autoload off."""
    registry = load_registry(autoload=False)
    assert {"verifier", "oracle"} <= set(registry.node_types)
    assert registry.node_types["verifier"].origin == "built-in"
    assert registry.node_types["verifier"].plugin.startswith("builtin_")


def test_unknown_hook_implementation_is_rejected():
    """An implementation of a hook that has no spec fails check_pending with a PluginError."""
    bad = types.ModuleType("bad_plugin")

    @hookimpl
    def draftflow_register_node(registry):  # typo: missing 's'
        pass

    bad.draftflow_register_node = draftflow_register_node
    with pytest.raises(PluginError, match="draftflow_register_node"):
        load_registry(extra_plugins=(("bad", bad),))


def test_unimportable_plugin_module_via_env(monkeypatch):
    """A plugin module that cannot be imported gives one line naming it."""
    monkeypatch.setenv("DRAFTFLOW_PLUGINS", "no_such_module_xyz")
    with pytest.raises(PluginError, match="DRAFTFLOW_PLUGINS names module 'no_such_module_xyz', which could not be imported"):
        load_registry()


def test_duplicate_node_type_names_both_plugins():
    """Two plugins registering the same node type name is an error naming both."""
    dup = types.ModuleType("dup")

    @hookimpl
    def draftflow_register_nodes(registry):
        registry.add_node_type(NodeType(name="verifier", role="verifier", manifest=lambda p, e: None, factory=object))

    dup.draftflow_register_nodes = draftflow_register_nodes
    with pytest.raises(PluginError, match="node type 'verifier' is registered by both plugin 'builtin_verifier'.*and plugin 'dup'"):
        load_registry(extra_plugins=(("dup", dup),))


def test_invalid_manifest_is_a_problem_naming_the_plugin():
    """A manifest that fails its validators becomes an [invalid-manifest] problem, not a traceback."""
    broken = types.ModuleType("broken")

    def manifest(params, env):
        return Manifest(role="drafter", provides={"Not A Capability!"})

    @hookimpl
    def draftflow_register_nodes(registry):
        registry.add_node_type(NodeType(name="broken-drafter", role="drafter", manifest=manifest, factory=object))

    broken.draftflow_register_nodes = draftflow_register_nodes
    registry = load_registry(extra_plugins=(("broken", broken),))
    plan = build_plan(graph_from_text("nodes: {d: {plugin: broken-drafter}}", "g.yaml"), registry)
    lines = [p.render() for p in plan.problems]
    assert any("[invalid-manifest]: plugin 'broken' could not declare a manifest: ValueError: provides entry 'Not A Capability!'" in l for l in lines), lines


def test_plugin_crash_during_registration_is_reported():
    """A plugin that raises inside draftflow_register_nodes gives a PluginError naming it."""
    crash = types.ModuleType("crash")

    @hookimpl
    def draftflow_register_nodes(registry):
        raise RuntimeError("boom")

    crash.draftflow_register_nodes = draftflow_register_nodes
    with pytest.raises(PluginError, match="plugin 'crash' .* failed in draftflow_register_nodes: RuntimeError: boom"):
        load_registry(extra_plugins=(("crash", crash),))


def test_every_hook_is_documented():
    """Every hookspec appears in docs/PLUGINS.md with a section of its own."""
    from helpers import ROOT

    from draftflow.core import hookspecs

    doc = (ROOT / "docs" / "PLUGINS.md").read_text()
    hooks = [n for n in dir(hookspecs) if n.startswith("draftflow_")]
    assert hooks
    missing = [h for h in hooks if f"### `{h}" not in doc]
    assert not missing, f"hooks not documented in docs/PLUGINS.md: {missing}"
