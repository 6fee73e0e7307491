"""Graph specs: YAML -> dict -> ``GraphSpec.from_dict``. The schema is in docs/GRAPHS.md."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import attrs

from draftflow.core.errors import SpecError
from draftflow.core.params import did_you_mean
from draftflow.core.yamlio import Located, key_path, load_yaml_file, load_yaml_text, load_yaml_value, shorten

MAX_BATCH = 256  # request slots a graph may ask for
MAX_TENSOR_PARALLEL = 64  # ranks a target may be sharded over
TOP_KEYS = ("name", "description", "extends", "device", "dtype", "vram_budget", "num_draft", "max_batch", "max_context", "debug",
            "tensor_parallel", "per_device", "nodes", "edges")
DEVICE_KINDS = ("cpu", "cuda")  # the keys of a graph's per_device section
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
    if isinstance(value, str) and (m := _SIZE.match(value)) and (size := float(m[1]) * _UNITS[m[2]]) < 2**63:
        return int(size)
    raise SpecError(f"{where}: vram_budget {shorten(repr(value))} is not a size; write bytes, '24GiB', or '90%'")


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
    max_batch: int | None = 1  # request slots; None = "auto" (as many as the VRAM plan fits, at most 64)
    max_context: int | None = None
    debug: bool = False
    tensor_parallel: int = 1  # ranks the target is sharded over (docs/TENSOR_PARALLEL.md)
    per_device: tuple[str, ...] = ()  # the per_device settings this run took, e.g. "cuda: nodes.drafter.min_path_prob=0"
    source: str = "<graph>"
    base_dir: Path | None = None
    located: Located | None = attrs.field(default=None, eq=False, repr=False)

    def node(self, name: str) -> NodeSpec | None:
        return next((n for n in self.nodes if n.name == name), None)

    def at(self, *path) -> str:
        return self.located.at(*path) if self.located else self.source

    def dir_of(self, *path) -> Path | None:
        """The folder a relative path at this key is relative to: the file that wrote the key (a base graph's own
        folder for what it passes on through `extends`), else `base_dir` (the graph file's; overrides)."""
        written = self.located.file_of(*path) if self.located else None
        if written and self.base_dir is not None and not written.startswith("<"):
            return Path(written).resolve().parent
        return self.base_dir

    @classmethod
    def from_dict(cls, data: Any, source: str = "<graph>", located: Located | None = None, base_dir: Path | None = None,
                  per_device: tuple[str, ...] = ()) -> "GraphSpec":
        loc = located or Located(source)
        if data is None or data == {}:
            raise SpecError(f"{source}: the graph is empty; it needs 'nodes:' (see graphs/demo.yaml for an example)")
        if not isinstance(data, dict):
            raise SpecError(f"{source}: the top level is {_kind(data)}, but a graph must be a mapping with 'nodes:' "
                            "(and optionally 'edges:'); see graphs/demo.yaml")
        if "per_device" in data:  # a dict that did not come through resolve_graph
            data, per_device = resolve_graph(data, [], located=loc)
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
            raise SpecError(f"{loc.at('device')}: device {shorten(repr(device))} is not 'cpu', 'cuda' or 'cuda:N'")
        dtype = data.get("dtype", "float32")
        if dtype not in COMPUTE_DTYPES:
            raise SpecError(f"{loc.at('dtype')}: dtype {shorten(repr(dtype))} is not one of {', '.join(COMPUTE_DTYPES)}")
        num_draft = data.get("num_draft", 4)
        if isinstance(num_draft, bool) or not isinstance(num_draft, int) or not 0 <= num_draft <= 64:
            raise SpecError(f"{loc.at('num_draft')}: num_draft must be an integer from 0 to 64, got {shorten(repr(num_draft))}")
        max_batch = data.get("max_batch", 1)
        if max_batch == "auto":
            max_batch = None
        elif isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= MAX_BATCH:
            raise SpecError(f"{loc.at('max_batch')}: max_batch must be an integer from 1 to {MAX_BATCH} or 'auto', "
                            f"got {shorten(repr(max_batch))}")
        max_context = data.get("max_context")
        if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1):
            raise SpecError(f"{loc.at('max_context')}: max_context must be a positive integer, got {shorten(repr(max_context))}")
        debug = data.get("debug", False)
        if not isinstance(debug, bool):
            raise SpecError(f"{loc.at('debug')}: debug must be true or false")
        tensor_parallel = data.get("tensor_parallel", 1)
        if (isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int)
                or not 1 <= tensor_parallel <= MAX_TENSOR_PARALLEL):
            raise SpecError(f"{loc.at('tensor_parallel')}: tensor_parallel must be an integer from 1 to "
                            f"{MAX_TENSOR_PARALLEL} (ranks, one GPU each), got {shorten(repr(tensor_parallel))}")
        for key in ("name", "description"):
            if isinstance(data.get(key), (dict, list)):
                raise SpecError(f"{loc.at(key)}: {key} must be text, got {_kind(data[key])}")
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
            max_batch=max_batch,
            max_context=max_context,
            debug=debug,
            tensor_parallel=tensor_parallel,
            per_device=tuple(per_device),
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
        elif key == "per_device" and isinstance(value, dict) and isinstance(out.get("per_device"), dict):
            for kind, settings in value.items():  # a child's settings for a kind add to (and win over) the base's
                base_settings = out["per_device"].get(kind)
                both = isinstance(base_settings, dict) and isinstance(settings, dict)
                out["per_device"][kind] = {**base_settings, **settings} if both else settings
        else:
            out[key] = value
    return out


def _kind(value: Any) -> str:
    kinds = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def read_graph_dict(path: Path, _seen: tuple = (), cited: str = ""):
    """Read a graph file and everything it ``extends:``; return (merged dict, Located).

    ``cited`` says where another file named this one, for errors about reading it.
    """
    path = Path(os.path.realpath(path))  # realpath, not resolve(): a symlink loop is reported on reading, not as a RuntimeError
    if path in _seen:
        chain = " -> ".join(str(p) for p in _seen + (path,))
        raise SpecError(f"{path}: 'extends' forms a loop ({chain}); remove one of the extends")
    data, loc = load_yaml_file(path, cited=cited)
    if data is None:
        raise SpecError(f"{path}: the graph file is empty; it needs 'nodes:' (see graphs/demo.yaml for an example)")
    if not isinstance(data, dict):
        raise SpecError(f"{path}: the top level is {_kind(data)}, but a graph must be a mapping with 'nodes:'; see graphs/demo.yaml")
    parent = data.get("extends")
    if parent is None:
        return data, loc
    if not isinstance(parent, str) or not parent.strip():
        raise SpecError(f"{loc.at('extends')}: 'extends' must be the path of another graph file, got {parent!r}")
    parent_path = (path.parent / parent) if not Path(parent).is_absolute() else Path(parent)
    base, base_loc = read_graph_dict(parent_path, _seen + (path,), cited=f"{loc.at('extends')}: extends {parent!r}")
    loc.merge(base_loc)
    return _merge(base, data), loc


def _override_path(parts: list[str], data: dict, where: str) -> tuple:
    """The key path a ``--set`` key names: ``nodes.X.P`` -> ('nodes', X, 'params', P)."""
    if parts[0] == "nodes":
        nodes = data.get("nodes")
        nodes = nodes if isinstance(nodes, dict) else {}
        if len(parts) < 3:
            raise SpecError(f"{where}: write nodes.<node>.<param>=<value>")
        if parts[1] not in nodes:
            raise SpecError(f"{where}: no node {parts[1]!r} in the graph; {did_you_mean(parts[1], nodes)}")
        if parts[2:] == ["plugin"]:
            return ("nodes", parts[1], "plugin")
        rest = parts[3:] if parts[2] == "params" else parts[2:]
        if not rest:
            raise SpecError(f"{where}: set one param at a time: nodes.{parts[1]}.params.<param>=<value>")
        return ("nodes", parts[1], "params", *rest)
    if parts[0] in ("extends", "per_device"):
        raise SpecError(f"{where}: {parts[0]!r} is read with the file and cannot be overridden; edit the graph file")
    if parts[0] not in TOP_KEYS:
        raise SpecError(f"{where}: unknown key {'.'.join(parts)!r}; {did_you_mean(parts[0], TOP_KEYS)}")
    if len(parts) > 1:
        raise SpecError(f"{where}: {parts[0]} is one value with no keys inside; write {parts[0]}=VALUE")
    return (parts[0],)


def resolve_graph(data: dict, overrides: list, source: str = "--set", located: Located | None = None) -> tuple[dict, tuple]:
    """Apply the graph's ``per_device`` settings for the device it runs on, then ``key.path=value`` overrides.

    ``nodes.X.P=v`` is short for ``nodes.X.params.P=v``. Values are YAML, read under the rules of a graph
    file. With ``located``, later errors about an overridden value name the override (or the
    ``per_device`` line) that gave it rather than a line of the file. An override is ``"KEY=VALUE"``
    (errors name it ``--set 'KEY=VALUE'``) or ``(label, "KEY=VALUE")`` for one that another flag stands
    for, e.g. ``("--device 'cuda'", "device=cuda")``. The device is the graph's after the overrides, so
    ``--device cuda`` picks ``per_device.cuda``; the overrides are applied last and win over it. Returns the
    graph dict and the per_device settings taken, as ``"KIND: KEY=VALUE"`` lines.
    """
    out = copy.deepcopy(data)
    parsed = []
    for entry in overrides:
        where, item = entry if isinstance(entry, tuple) else (f"{source} {entry!r}", entry)
        if "=" not in item:
            raise SpecError(f"{where}: expected KEY=VALUE, e.g. nodes.target.params.kv_mode=grow or num_draft=8")
        key, raw = item.split("=", 1)
        parsed.append((key, load_yaml_value(raw, where) if raw != "" else "", where))
    section, taken = out.pop("per_device", None), []
    if section is not None:
        device = next((v for k, v, _ in reversed(parsed) if k.strip() == "device"), out.get("device", "cpu"))
        kind, settings = per_device_settings(section, device, located or Located("<graph>"))
        for key, value, where in settings:
            _assign(out, key, value, where, located)
            taken.append(f"{kind}: {key}={value}")
    for key, value, where in parsed:
        _assign(out, key, value, where, located)
    return out, tuple(taken)


def per_device_settings(section: Any, device: Any, loc: Located) -> tuple[str | None, list]:
    """The device kind and the (key, value, where) settings a graph's ``per_device`` section gives a run on ``device``."""
    if not isinstance(section, dict):
        raise SpecError(f"{loc.at('per_device')}: per_device must be a mapping of device kind ({', '.join(DEVICE_KINDS)}) "
                        "-> settings, e.g. per_device: {cuda: {nodes.drafter.min_path_prob: 0}}")
    for kind, settings in section.items():
        if kind not in DEVICE_KINDS:
            raise SpecError(f"{loc.at('per_device', kind)}: per_device: {shorten(repr(kind))} is not a device kind; "
                            f"write one of {', '.join(DEVICE_KINDS)} (cuda covers cuda:N)")
        if not isinstance(settings, dict):
            raise SpecError(f"{loc.at('per_device', kind)}: per_device.{kind} must be a mapping of KEY: VALUE, the keys "
                            "--set takes (e.g. nodes.drafter.min_path_prob: 0)")
        for key in settings:
            if not isinstance(key, str) or key.strip().split(".")[0] in ("device", "per_device", "tensor_parallel"):
                raise SpecError(f"{loc.at('per_device', kind, key)}: per_device.{kind}: {shorten(repr(key))} cannot be set "
                                "per device (the device picks the section; tensor_parallel decides how many processes "
                                "start before it is read); write the keys --set takes, other than these")
    kind = device.split(":")[0] if isinstance(device, str) else None  # a bad device is reported with the rest of the graph
    settings = section.get(kind) or {}
    return kind, [(key, value, f"{loc.at('per_device', kind, key)}: per_device.{kind}") for key, value in settings.items()]


def _assign(out: dict, key: str, value: Any, where: str, located: Located | None) -> None:
    """Set the value a ``--set`` key names in ``out`` (in place)."""
    parts = key.strip().split(".")
    if not all(p.strip() for p in parts):
        raise SpecError(f"{where}: the key {key!r} has an empty part; write KEY=VALUE, e.g. num_draft=8 or nodes.target.kv_mode=grow")
    path = _override_path(parts, out, where)
    parent = out
    for i, p in enumerate(path[:-1]):
        if parent.get(p) is None:
            parent[p] = {}
        elif not isinstance(parent[p], dict):
            inside = key_path(path[:i + 1])
            raise SpecError(f"{where}: {inside} is {_kind(parent[p])}, not a mapping, so {path[i + 1]!r} cannot be set "
                            f"inside it; set {inside} itself")
        parent = parent[p]
    parent[path[-1]] = value
    if located is not None:
        located.replace(path, where)


def load_graph(path: Path | str, overrides: list[str] = ()) -> GraphSpec:
    """Read, merge ``extends``, apply overrides and validate a graph file."""
    data, loc = read_graph_dict(Path(path))
    data, taken = resolve_graph(data, list(overrides), located=loc)
    return GraphSpec.from_dict(data, source=str(path), located=loc, base_dir=Path(path).resolve().parent, per_device=taken)


def graph_from_text(text: str, source: str = "<graph>", overrides: list[str] = ()) -> GraphSpec:
    data, loc = load_yaml_text(text, source)
    taken = ()
    if isinstance(data, dict):
        data, taken = resolve_graph(data, list(overrides), located=loc)
    return GraphSpec.from_dict(data, source=source, located=loc, base_dir=None, per_device=taken)
