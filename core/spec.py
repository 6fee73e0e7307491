"""Graph specs: YAML -> dict -> ``GraphSpec.from_dict``. The schema is in docs/GRAPHS.md."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import attrs
import yaml

from draftflow.core.errors import SpecError
from draftflow.core.params import did_you_mean
from draftflow.core.yamlio import Located, load_yaml_file, load_yaml_text

TOP_KEYS = ("name", "description", "extends", "device", "dtype", "vram_budget", "num_draft", "max_context", "debug", "nodes", "edges")
NODE_KEYS = ("plugin", "params")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
_EDGE = re.compile(r"^\s*([A-Za-z_][\w-]*)\.(\w+)\s*->\s*([A-Za-z_][\w-]*)\.(\w+)\s*(\(carried\))?\s*$")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$")
_UNITS = {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


@attrs.frozen
class NodeSpec:
    name: str
    plugin: str
    params: dict = attrs.field(factory=dict)
    where: str = ""


@attrs.frozen(order=True)
class EdgeSpec:
    """``src.src_port -> dst.dst_port``; carried edges deliver the previous cycle's value."""

    src: str
    src_port: str
    dst: str
    dst_port: str
    carried: bool = False
    where: str = attrs.field(default="", eq=False, order=False)

    def render(self) -> str:
        return f"{self.src}.{self.src_port} -> {self.dst}.{self.dst_port}" + (" (carried)" if self.carried else "")

    @classmethod
    def parse(cls, text: Any, where: str) -> "EdgeSpec":
        m = _EDGE.match(text) if isinstance(text, str) else None
        if not m:
            raise SpecError(f"{where}: edge {text!r} is not of the form 'src.port -> dst.port' (optionally followed by '(carried)')")
        return cls(m[1], m[2], m[3], m[4], bool(m[5]), where)


def parse_size(value: Any, where: str) -> int | float | None:
    """Bytes as int, a fraction of device memory as float (from 'N%'), or None (unlimited)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise SpecError(f"{where}: vram_budget must be bytes, a size like '24GiB' or a share like '90%'")
    if isinstance(value, int) and value > 0:
        return value
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            share = float(value.strip()[:-1]) / 100
        except ValueError:
            share = -1
        if 0 < share <= 1:
            return share
    if isinstance(value, str) and (m := _SIZE.match(value)):
        return int(float(m[1]) * _UNITS[m[2]])
    raise SpecError(f"{where}: vram_budget {value!r} is not a size; write bytes, '24GiB', or '90%'")


@attrs.frozen
class GraphSpec:
    """A validated decode graph, before any plugin is consulted."""

    name: str
    nodes: tuple[NodeSpec, ...]
    edges: tuple[EdgeSpec, ...] = ()
    description: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    vram_budget: int | float | None = None
    num_draft: int = 4
    max_context: int | None = None
    debug: bool = False
    source: str = "<graph>"
    base_dir: Path | None = None
    located: Located | None = attrs.field(default=None, eq=False, repr=False)

    def node(self, name: str) -> NodeSpec | None:
        return next((n for n in self.nodes if n.name == name), None)

    def at(self, *path) -> str:
        return self.located.at(*path) if self.located else self.source

    @classmethod
    def from_dict(cls, data: Any, source: str = "<graph>", located: Located | None = None, base_dir: Path | None = None) -> "GraphSpec":
        loc = located or Located(source)
        if not isinstance(data, dict):
            raise SpecError(f"{source}: a graph must be a mapping with 'nodes:' (and optionally 'edges:')")
        for key in data:
            if key not in TOP_KEYS:
                raise SpecError(f"{loc.at(key)}: unknown key {key!r}; {did_you_mean(key, TOP_KEYS)}")
        nodes_raw = data.get("nodes")
        if not isinstance(nodes_raw, dict) or not nodes_raw:
            raise SpecError(f"{loc.at('nodes')}: 'nodes' must be a non-empty mapping of node name -> {{plugin, params}}")
        nodes = []
        for name, body in nodes_raw.items():
            where = loc.at("nodes", name)
            if not re.match(r"^[A-Za-z_][\w-]*$", name):
                raise SpecError(f"{where}: node name {name!r} must be letters, digits, '_' or '-'")
            if not isinstance(body, dict):
                raise SpecError(f"{where}: node {name!r} must be a mapping with 'plugin' (and optional 'params')")
            for key in body:
                if key not in NODE_KEYS:
                    raise SpecError(f"{loc.at('nodes', name, key)}: node {name!r}: unknown key {key!r}; {did_you_mean(key, NODE_KEYS)}")
            plugin = body.get("plugin")
            if not isinstance(plugin, str):
                raise SpecError(f"{where}: node {name!r} needs 'plugin: <node type>' (see `draftflow plugins`)")
            params = body.get("params") or {}
            if not isinstance(params, dict):
                raise SpecError(f"{loc.at('nodes', name, 'params')}: node {name!r}: 'params' must be a mapping")
            nodes.append(NodeSpec(name, plugin, dict(params), where))
        edges_raw = data.get("edges") or []
        if not isinstance(edges_raw, list):
            raise SpecError(f"{loc.at('edges')}: 'edges' must be a list of 'src.port -> dst.port' strings")
        edges = tuple(EdgeSpec.parse(e, loc.at("edges", i)) for i, e in enumerate(edges_raw))
        device = data.get("device", "cpu")
        if not isinstance(device, str) or not _DEVICE.match(device):
            raise SpecError(f"{loc.at('device')}: device {device!r} is not 'cpu', 'cuda' or 'cuda:N'")
        dtype = data.get("dtype", "float32")
        if dtype not in COMPUTE_DTYPES:
            raise SpecError(f"{loc.at('dtype')}: dtype {dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")
        num_draft = data.get("num_draft", 4)
        if isinstance(num_draft, bool) or not isinstance(num_draft, int) or not 0 <= num_draft <= 64:
            raise SpecError(f"{loc.at('num_draft')}: num_draft must be an integer from 0 to 64, got {num_draft!r}")
        max_context = data.get("max_context")
        if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1):
            raise SpecError(f"{loc.at('max_context')}: max_context must be a positive integer, got {max_context!r}")
        debug = data.get("debug", False)
        if not isinstance(debug, bool):
            raise SpecError(f"{loc.at('debug')}: debug must be true or false")
        name = data.get("name") or (Path(source).stem if source != "<graph>" else "graph")
        return cls(
            name=str(name),
            nodes=tuple(nodes),
            edges=edges,
            description=str(data.get("description", "")),
            device=device,
            dtype=dtype,
            vram_budget=parse_size(data.get("vram_budget"), loc.at("vram_budget")),
            num_draft=num_draft,
            max_context=max_context,
            debug=debug,
            source=source,
            base_dir=base_dir,
            located=loc,
        )


def _merge(base: dict, child: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in child.items():
        if key == "extends":
            continue
        if key == "nodes" and isinstance(value, dict) and isinstance(out.get("nodes"), dict):
            for name, body in value.items():
                if body is None:  # `name: null` removes an inherited node
                    out["nodes"].pop(name, None)
                elif isinstance(body, dict) and isinstance(out["nodes"].get(name), dict):
                    merged = dict(out["nodes"][name])
                    merged.update({k: v for k, v in body.items() if k != "params"})
                    if "plugin" in body and body["plugin"] != out["nodes"][name].get("plugin"):
                        merged["params"] = dict(body.get("params") or {})
                    else:
                        merged["params"] = {**(out["nodes"][name].get("params") or {}), **(body.get("params") or {})}
                    out["nodes"][name] = merged
                else:
                    out["nodes"][name] = body
        elif key == "edges" and isinstance(value, list) and isinstance(out.get("edges"), list):
            out["edges"] = out["edges"] + [e for e in value if e not in out["edges"]]
        else:
            out[key] = value
    return out


def read_graph_dict(path: Path, _seen: tuple = ()):
    """Read a graph file and everything it ``extends:``; return (merged dict, Located)."""
    path = Path(path).resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in _seen + (path,))
        raise SpecError(f"{path}: 'extends' forms a loop ({chain}); remove one of the extends")
    data, loc = load_yaml_file(path)
    if not isinstance(data, dict):
        raise SpecError(f"{path}: a graph must be a mapping with 'nodes:'")
    parent = data.get("extends")
    if parent is None:
        return data, loc
    if not isinstance(parent, str):
        raise SpecError(f"{loc.at('extends')}: 'extends' must be a path to another graph file")
    parent_path = (path.parent / parent) if not Path(parent).is_absolute() else Path(parent)
    if not parent_path.exists():
        raise SpecError(f"{loc.at('extends')}: extends {parent!r}, but {parent_path} does not exist")
    base, base_loc = read_graph_dict(parent_path, _seen + (path,))
    loc.merge(base_loc)
    return _merge(base, data), loc


def apply_overrides(data: dict, overrides: list[str], source: str = "--set") -> dict:
    """Apply ``key.path=value`` overrides; ``nodes.X.P=v`` is short for ``nodes.X.params.P=v``."""
    out = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise SpecError(f"{source} {item!r}: expected KEY=VALUE, e.g. nodes.target.params.kv_mode=grow or num_draft=8")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        parts = key.strip().split(".")
        if parts[0] == "nodes":
            if len(parts) < 3:
                raise SpecError(f"{source} {item!r}: write nodes.<node>.<param>=<value>")
            nodes = out.setdefault("nodes", {})
            if parts[1] not in nodes:
                raise SpecError(f"{source} {item!r}: no node {parts[1]!r} in the graph; {did_you_mean(parts[1], nodes)}")
            node = nodes[parts[1]]
            if parts[2] == "plugin" and len(parts) == 3:
                node["plugin"] = value
                continue
            rest = parts[3:] if parts[2] == "params" else parts[2:]
            if not rest:
                raise SpecError(f"{source} {item!r}: write nodes.<node>.<param>=<value>")
            target = node.setdefault("params", {}) or {}
            node["params"] = target
            for p in rest[:-1]:
                target = target.setdefault(p, {})
            target[rest[-1]] = value
        elif len(parts) == 1 and parts[0] in TOP_KEYS:
            out[parts[0]] = value
        else:
            raise SpecError(f"{source} {item!r}: unknown key {key!r}; {did_you_mean(parts[0], TOP_KEYS)}")
    return out


def load_graph(path: Path | str, overrides: list[str] = ()) -> GraphSpec:
    """Read, merge ``extends``, apply overrides and validate a graph file."""
    data, loc = read_graph_dict(Path(path))
    data = apply_overrides(data, list(overrides))
    return GraphSpec.from_dict(data, source=str(path), located=loc, base_dir=Path(path).resolve().parent)


def graph_from_text(text: str, source: str = "<graph>", overrides: list[str] = ()) -> GraphSpec:
    data, loc = load_yaml_text(text, source)
    data = apply_overrides(data if isinstance(data, dict) else {}, list(overrides)) if isinstance(data, dict) else data
    return GraphSpec.from_dict(data, source=source, located=loc, base_dir=None)
