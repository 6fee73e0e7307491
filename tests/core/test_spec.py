"""Graph spec parsing: YAML positions, schema errors, extends, overrides."""

from __future__ import annotations

import pytest
from helpers import FIXTURES

from draftflow.core.errors import SpecError
from draftflow.core.spec import EdgeSpec, graph_from_text, load_graph, parse_size


def test_malformed_yaml_names_file_line_and_column():
    """A YAML syntax error is reported with file:line:col."""
    with pytest.raises(SpecError, match=r"malformed\.yaml:3:\d+: malformed YAML"):
        load_graph(FIXTURES / "malformed.yaml")


def test_unknown_top_key_suggests_close_name():
    """An unknown top-level key gets a did-you-mean and its position."""
    with pytest.raises(SpecError, match=r"unknown_top_key\.yaml:1:1: unknown key 'nodez'; did you mean 'nodes'\?"):
        load_graph(FIXTURES / "unknown_top_key.yaml")


def test_unknown_node_key_suggests_params():
    """An unknown key inside a node names the node and suggests 'params'."""
    with pytest.raises(SpecError, match=r"node 'target': unknown key 'parms'; did you mean 'params'\?"):
        load_graph(FIXTURES / "unknown_node_key.yaml")


@pytest.mark.parametrize("text, message", [
    ("nodes: []", "'nodes' must be a non-empty mapping"),
    ("nodes: {t: {plugin: 3}}", "needs 'plugin: <node type>'"),
    ("nodes: {t: {plugin: x}}\ndevice: tpu", "device 'tpu' is not 'cpu', 'cuda' or 'cuda:N'"),
    ("nodes: {t: {plugin: x}}\ndtype: float8", "dtype 'float8' is not one of"),
    ("nodes: {t: {plugin: x}}\nnum_draft: many", "num_draft must be an integer"),
    ("nodes: {t: {plugin: x}}\nvram_budget: lots", "vram_budget 'lots' is not a size"),
    ("nodes: {t: {plugin: x}}\nedges: ['t.a => u.b']", "is not of the form 'src.port -> dst.port'"),
    ("- just\n- a list", "a graph must be a mapping"),
])
def test_wrong_types_are_one_line_errors(text, message):
    """Each wrong type in a spec is a SpecError with a readable one-line message."""
    with pytest.raises(SpecError, match=message) as info:
        graph_from_text(text, "g.yaml")
    assert "\n" not in str(info.value)


def test_edge_parsing_and_carried_marker():
    """Edges are 'a.x -> b.y', optionally '(carried)'."""
    e = EdgeSpec.parse("target.features -> drafter.features (carried)", "here")
    assert (e.src, e.src_port, e.dst, e.dst_port, e.carried) == ("target", "features", "drafter", "features", True)
    assert EdgeSpec.parse("a.b->c.d", "here").carried is False


def test_sizes():
    """vram_budget accepts bytes, binary/decimal units and shares."""
    assert parse_size("24GiB", "x") == 24 * 2**30
    assert parse_size("1.5 MB", "x") == 1_500_000
    assert parse_size(1000, "x") == 1000
    assert parse_size("90%", "x") == pytest.approx(0.9)


def test_extends_merges_params_and_nodes():
    """A child inherits nodes, overrides params key by key and adds nodes."""
    spec = load_graph(FIXTURES / "child.yaml")
    assert spec.name == "child" and spec.num_draft == 2
    assert spec.node("target").params == {"vocab": 64, "context": 256}
    assert [n.name for n in spec.nodes] == ["target", "verify", "drafter"]


def test_extends_loop_is_an_error():
    """A loop of extends is reported with the chain."""
    with pytest.raises(SpecError, match="'extends' forms a loop"):
        load_graph(FIXTURES / "loop_a.yaml")


def test_set_overrides():
    """--set nodes.X.P=V sets a node param (parsed as YAML); top-level keys too; unknown nodes are errors."""
    spec = load_graph(FIXTURES / "good_toy.yaml", ["nodes.target.kv_mode=grow", "nodes.drafter.params.wrong_at=[0,1]", "num_draft=7"])
    assert spec.node("target").params["kv_mode"] == "grow"
    assert spec.node("drafter").params["wrong_at"] == [0, 1]
    assert spec.num_draft == 7
    with pytest.raises(SpecError, match="no node 'targte' in the graph; did you mean 'target'"):
        load_graph(FIXTURES / "good_toy.yaml", ["nodes.targte.vocab=3"])
    with pytest.raises(SpecError, match="expected KEY=VALUE"):
        load_graph(FIXTURES / "good_toy.yaml", ["num_draft"])
