"""Graph spec parsing: YAML positions, schema errors, extends, overrides."""

from __future__ import annotations

import re
from pathlib import Path

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


def test_unreadable_graph_file_says_permission_denied(tmp_path, monkeypatch):
    """A graph file that cannot be opened for lack of permission says so, not 'no such file' (simulated: tests run as root)."""
    import errno

    from draftflow.core import yamlio

    graph = tmp_path / "g.yaml"
    graph.write_text("nodes: {t: {plugin: x}}\n")

    def denied(path, mode="r", *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(yamlio, "open", denied, raising=False)
    with pytest.raises(SpecError, match=r"g\.yaml: cannot read the graph file: permission denied; make the file readable") as info:
        load_graph(graph)
    assert "No such file" not in str(info.value)


def test_only_plain_tags_are_read():
    """Tags outside str/int/float/bool/null/timestamp are refused with file:line:col, the key path and the tag; nothing is constructed."""
    with pytest.raises(SpecError, match=r"^g\.yaml:2:15: nodes\.t\.plugin: the YAML tag !!python/name:os\.system is not allowed"):
        graph_from_text("nodes:\n  t: {plugin: !!python/name:os.system x}\n", "g.yaml")
    with pytest.raises(SpecError, match=r"^g\.yaml:1:12: num_draft: 'abc' is not a valid !!int value"):
        graph_from_text('num_draft: !!int "abc"\nnodes: {t: {plugin: x}}\n', "g.yaml")
    spec = graph_from_text('name: !!str 7\nnum_draft: !!int "2"\nnodes: {t: {plugin: x}}\n', "g.yaml")
    assert (spec.name, spec.num_draft) == ("7", 2)


def test_alias_copies_are_bounded(monkeypatch):
    """Aliases may copy at most MAX_ALIAS_COPIES values in all; the error names the anchor and where it was used."""
    from draftflow.core import yamlio

    monkeypatch.setattr(yamlio, "MAX_ALIAS_COPIES", 20)
    text = "a: &a [1, 2, 3, 4, 5]\nb: [*a, *a, *a]\n"  # each *a copies 6 values (the list and its items)
    assert yamlio.load_yaml_text(text, "g.yaml")[0]["b"] == [[1, 2, 3, 4, 5]] * 3  # 18 copies: under the bound
    with pytest.raises(SpecError, match=r"^g\.yaml:1:4: c\[0\]: aliases \(\*name\) expand to more than 20 copied values"):
        yamlio.load_yaml_text(text + "c: [*a]\n", "g.yaml")


def test_recursive_alias_is_an_error_not_a_recursion_error():
    """An alias inside the value it names is reported where it is used."""
    with pytest.raises(SpecError, match=r"^g\.yaml:1:8: nodes\.x: this alias refers to a value that contains it"):
        graph_from_text("nodes: &a {x: *a}\n", "g.yaml")


def test_merge_keys_merge_and_explicit_keys_win():
    """`<<: *base` merges a shared mapping; keys written beside it override; positions stay with the text."""
    text = "nodes:\n  a: {plugin: x, params: &p {vocab: 32, context: 64}}\n  b: {plugin: x, params: {<<: *p, vocab: 48}}\n"
    spec = graph_from_text(text, "g.yaml")
    assert spec.node("b").params == {"vocab": 48, "context": 64}
    assert spec.node("a").params == {"vocab": 32, "context": 64}
    assert spec.at("nodes", "b", "params", "vocab") == "g.yaml:3:35"


def test_set_errors_name_the_override_not_the_file():
    """A wrong value given with --set is blamed on that --set, not on the line of the file it replaced."""
    with pytest.raises(SpecError, match=r"^--set 'num_draft=x': num_draft must be an integer"):
        load_graph(FIXTURES / "good_toy.yaml", ["num_draft=x"])
    spec = load_graph(FIXTURES / "good_toy.yaml", ["nodes.target.kv_mode=banana"])
    assert spec.at("nodes", "target", "params", "kv_mode") == "--set 'nodes.target.kv_mode=banana'"
    assert spec.at("nodes", "target", "params", "vocab").startswith(str(FIXTURES))


@pytest.mark.parametrize("item, message", [
    ("nodes..x=1", "has an empty part"),
    ("nodes.target.vocab.x=1", r"nodes\.target\.params\.vocab is a number, not a mapping"),
    ("num_draft.x=1", "num_draft is one value with no keys inside"),
    ("extends=base.yaml", "'extends' is read with the file"),
    ("nodes.target.params=5", "set one param at a time"),
    ("name=!!python/name:os.system", "the YAML tag !!python/name:os.system is not allowed"),
])
def test_malformed_set_items(item, message):
    """Each malformed --set is one SpecError naming the --set."""
    with pytest.raises(SpecError, match=message) as info:
        load_graph(FIXTURES / "good_toy.yaml", [item])
    assert str(info.value).startswith(f"--set {item!r}: ") and "\n" not in str(info.value)


@pytest.mark.parametrize("built, count, device, message", [
    (False, 0, "cuda", r"needs CUDA, but this torch build .* has no CUDA support"),
    (True, 0, "cuda:0", "is built with CUDA but sees no CUDA device"),
    (True, 1, "cuda:1", r"device 'cuda:1' does not exist: this machine has 1 CUDA device$"),
    (True, 2, "cuda:1", None),
])
def test_device_problem(monkeypatch, built, count, device, message):
    """An unusable CUDA device is a check problem naming the reason (no CUDA build, no device, index out of range)."""
    import torch

    from draftflow.core.plan import device_problem

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: built)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    found = device_problem(device)
    if message is None:
        assert found is None
    else:
        assert re.search(message, found[0]) and "device cpu" in found[1]
    assert device_problem("cpu") is None


def test_override_from_another_flag_is_named_by_that_flag():
    """An override given as (label, KEY=VALUE), e.g. what --device stands for, is blamed on that label."""
    with pytest.raises(SpecError, match=r"^--device 'banana': device 'banana' is not"):
        load_graph(FIXTURES / "good_toy.yaml", [("--device 'banana'", "device=banana")])


PER_DEVICE = """
extends: {base}
per_device:
  cpu: {{num_draft: 2}}
  cuda:
    num_draft: 9
    nodes.drafter.wrong_at: [5]
"""


def _per_device_graph(tmp_path, text=PER_DEVICE):
    graph = tmp_path / "g.yaml"
    graph.write_text(text.format(base=FIXTURES / "good_toy.yaml"))
    return graph


def test_per_device_settings_follow_the_device_and_set_wins(tmp_path):
    """per_device.KIND applies for the device after --set/--device (cuda:N is cuda); explicit overrides still win."""
    graph = _per_device_graph(tmp_path)
    cpu = load_graph(graph)
    assert cpu.device == "cpu" and cpu.num_draft == 2 and cpu.node("drafter").params["wrong_at"] == [2]
    cuda = load_graph(graph, [("--device 'cuda:1'", "device=cuda:1")])
    assert cuda.num_draft == 9 and cuda.node("drafter").params["wrong_at"] == [5]
    assert load_graph(graph, ["num_draft=4", "device=cuda"]).num_draft == 4
    assert load_graph(graph, ["device=cuda", "device=cpu"]).num_draft == 2  # the last --set device decides


def test_per_device_merges_through_extends(tmp_path):
    """A child's per_device.KIND adds to the base's key by key, its own keys winning."""
    base = _per_device_graph(tmp_path)
    child = tmp_path / "child.yaml"
    child.write_text(f"extends: {base}\nper_device:\n  cuda: {{num_draft: 11}}\n")
    spec = load_graph(child, ["device=cuda"])
    assert spec.num_draft == 11 and spec.node("drafter").params["wrong_at"] == [5]


@pytest.mark.parametrize("section, message", [
    ("per_device: [cuda]", r"g\.yaml:2:\d+: per_device must be a mapping of device kind"),
    ("per_device: {gpu: {num_draft: 3}}", r"g\.yaml:2:\d+: per_device: 'gpu' is not a device kind; write one of cpu, cuda"),
    ("per_device: {cuda: 3}", r"g\.yaml:2:\d+: per_device\.cuda must be a mapping of KEY: VALUE"),
    ("per_device: {cpu: {device: cuda}}", r"g\.yaml:2:\d+: per_device\.cpu: 'device' cannot be set per device"),
    ("per_device: {cuda: {tensor_parallel: 2}}", r"g\.yaml:2:\d+: per_device\.cuda: 'tensor_parallel' cannot be set"),
    ("per_device: {cpu: {nodes.nope.x: 1}}", r"g\.yaml:2:\d+: per_device\.cpu: no node 'nope' in the graph"),
])
def test_per_device_errors_name_the_line(tmp_path, section, message):
    """A malformed per_device section is one error at its file:line, checked whatever the device."""
    graph = tmp_path / "g.yaml"
    graph.write_text(f"extends: {FIXTURES / 'good_toy.yaml'}\n{section}\n")
    with pytest.raises(SpecError, match=message):
        load_graph(graph)


def test_per_device_cannot_be_set(tmp_path):
    with pytest.raises(SpecError, match="'per_device' is read with the file and cannot be overridden"):
        load_graph(FIXTURES / "good_toy.yaml", ["per_device.cuda.num_draft=3"])


def test_a_per_device_value_error_names_its_line(tmp_path):
    """A bad value from per_device is blamed on the per_device line, not the node's."""
    graph = _per_device_graph(tmp_path, "extends: {base}\nper_device:\n  cpu: {{num_draft: 99}}\n")
    with pytest.raises(SpecError, match=r"g\.yaml:3:\d+: per_device\.cpu: num_draft must be an integer from 0 to 64"):
        load_graph(graph)


def test_shipped_demo_graphs_cut_blocks_on_the_cpu_only():
    """The demo graphs cut drafter blocks by confidence on the CPU and verify whole blocks on CUDA (docs/GRAPHS.md)."""
    graphs = Path(__file__).resolve().parents[2] / "graphs"
    for name, node in (("demo.yaml", "dflash2"), ("demo-dflash.yaml", "drafter"), ("demo-dflash2.yaml", "drafter")):
        assert load_graph(graphs / name).node(node).params["min_path_prob"] == 0.01
        assert load_graph(graphs / name, ["device=cuda"]).node(node).params["min_path_prob"] == 0
