"""GraphPlan: a GraphSpec resolved against the registry, wired, ordered and checked.

Building a plan reads manifests only; nothing is allocated. Every problem found is
collected; ``raise_if_problems`` turns them into one CheckError report.
"""

from __future__ import annotations

import attrs
import networkx as nx

from draftflow.core.budget import AUTO_BATCH_CAP, VramPlan, plan_vram
from draftflow.core.errors import CheckError, DraftflowError
from draftflow.core.manifest import Manifest
from draftflow.core.params import did_you_mean, validate_params
from draftflow.core.problems import Problem
from draftflow.core.registry import NodeType, Registry
from draftflow.core.spec import EdgeSpec, GraphSpec

ROLE_RANK = {"target": 0, "drafter": 1, "selector": 2, "other": 3, "verifier": 4, "policy": 5}


@attrs.frozen
class Env:
    """What a manifest may depend on besides its params."""

    device: str
    dtype: str
    num_draft: int
    max_context: int | None
    # Request slots the plan may allocate (max_batch, or auto's cap): size per-batch scratch by it.
    max_batch: int = 1
    # Ranks the target is sharded over: a target that shards declares one rank's share (docs/TENSOR_PARALLEL.md).
    tensor_parallel: int = 1


@attrs.frozen
class ResolvedNode:
    name: str
    node_type: NodeType
    params: dict
    manifest: Manifest


@attrs.frozen
class UnresolvedNode:
    """A node of a known type whose params or manifest failed: later checks may still read it.

    ``params`` holds the params that validated (the failed ones are absent). A check uses it
    to say what the failure causes, or to leave out a knock-on problem (see check_capabilities).
    """

    name: str
    node_type: NodeType
    params: dict


@attrs.define
class BufferInfo:
    name: str
    owners: list[str]
    readers: list[str]
    writers: list[str]
    nbytes: int = 0


@attrs.define
class GraphPlan:
    spec: GraphSpec
    env: Env
    nodes: dict[str, ResolvedNode] = attrs.field(factory=dict)
    unresolved: dict[str, UnresolvedNode] = attrs.field(factory=dict)
    edges: list[EdgeSpec] = attrs.field(factory=list)
    graph: nx.DiGraph = attrs.field(factory=nx.DiGraph)
    order: list[str] = attrs.field(factory=list)
    buffers: dict[str, BufferInfo] = attrs.field(factory=dict)
    vram: VramPlan | None = None
    problems: list[Problem] = attrs.field(factory=list)

    def problem(self, node: str, rule: str, message: str, fix: str, where: str = "") -> None:
        plugin = self.nodes[node].node_type.name if node in self.nodes else (
            self.spec.node(node).plugin if node and self.spec.node(node) else "")
        where = where or (self.spec.node(node).where if node and self.spec.node(node) else self.spec.source)
        self.problems.append(Problem(node, rule, message, fix, plugin, where))

    def by_role(self, role: str) -> list[str]:
        return [n for n in self.order or self.nodes if n in self.nodes and self.nodes[n].manifest.role == role]

    def inputs_of(self, node: str) -> list[EdgeSpec]:
        return [e for e in self.edges if e.dst == node]

    def raise_if_problems(self) -> None:
        if self.problems:
            raise CheckError(self.problems, graph_name=self.spec.source)


def device_problem(device: str) -> tuple[str, str] | None:
    """(message, fix) when this torch build on this machine cannot use ``device``, else None."""
    if not device.startswith("cuda"):
        return None
    import torch

    cpu_fix = "or run on the CPU (device: cpu in the graph, --device cpu or --set device=cpu)"
    if not torch.backends.cuda.is_built():
        return (f"device {device!r} needs CUDA, but this torch build ({torch.__version__}) has no CUDA support",
                f"install a CUDA build of torch (https://pytorch.org/get-started/locally/), {cpu_fix}")
    count = torch.cuda.device_count()
    if count == 0:
        return (f"device {device!r}: torch {torch.__version__} is built with CUDA but sees no CUDA device",
                f"check the NVIDIA driver and CUDA_VISIBLE_DEVICES, {cpu_fix}")
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        return (f"device {device!r} does not exist: this machine has {count} CUDA device{'s' if count > 1 else ''}",
                f"use {'cuda:0' if count == 1 else f'cuda:0 to cuda:{count - 1}'}, {cpu_fix}")
    return None


def device_budget(spec: GraphSpec) -> int | None:
    """The budget in bytes: explicit bytes, a share of device memory, or 90% of a CUDA device."""
    budget = spec.vram_budget
    if spec.device.startswith("cuda"):
        import torch

        if device_problem(spec.device) is not None:  # build_plan reports it
            return budget if isinstance(budget, int) else None
        total = torch.cuda.get_device_properties(torch.device(spec.device)).total_memory
        if budget is None:
            return int(total * 0.9)
        if isinstance(budget, float):
            return int(total * budget)
        return budget
    if isinstance(budget, float):
        return None  # a share of host memory is not a useful limit; treat as unlimited
    return budget


def build_plan(spec: GraphSpec, registry: Registry) -> GraphPlan:
    """Resolve, wire, order and check ``spec``; problems are collected on the plan."""
    env = Env(spec.device, spec.dtype, spec.num_draft, spec.max_context, spec.max_batch or AUTO_BATCH_CAP,
              spec.tensor_parallel)
    plan = GraphPlan(spec=spec, env=env)
    if (unusable := device_problem(spec.device)) is not None:
        plan.problem("", "device", *unusable, where=spec.at("device"))
    _resolve_nodes(plan, registry)
    _wire(plan)
    _order(plan)
    _collect_buffers(plan)
    for check in registry.checks:
        try:
            found = list(check.fn(plan) or ())
        except DraftflowError as exc:  # a user's file the check read is wrong: its message says how
            plan.problem("", check.name, str(exc), "")
            continue
        except OSError as exc:
            plan.problem("", check.name, _os_message(exc), "make the file readable or point at another one")
            continue
        except Exception as exc:
            plan.problem("", "check-crashed", f"check {check.name!r} from plugin {check.plugin!r} raised {type(exc).__name__}: {exc}",
                         f"report this to the author of plugin {check.plugin!r}")
            continue
        plan.problems.extend(found)
    manifests = {n: r.manifest for n, r in plan.nodes.items()}
    if manifests:
        plan.vram, vram_problems = plan_vram(manifests, device_budget(spec), spec.max_context, spec.max_batch)
        for node, message, fix in vram_problems:
            # A node's pinned expert_cache that cannot work is that param's problem; the rest is the budget's.
            param = node and message.startswith("expert_cache=")
            where = spec.at("nodes", node, "params", "expert_cache") if param else spec.at("vram_budget")
            plan.problem(node, "vram", message, fix, where=where)
        for info in plan.buffers.values():
            owner = plan.nodes.get(info.owners[0]) if info.owners else None
            spec_b = next((b for b in owner.manifest.owns if b.name == info.name), None) if owner else None
            if spec_b is not None:
                known = plan.vram.kv_tokens or not spec_b.per_token
                info.nbytes = spec_b.nbytes(plan.vram.kv_tokens, plan.vram.batch) if known else 0
    plan.problems.sort()
    return plan


def _resolve_nodes(plan: GraphPlan, registry: Registry) -> None:
    for node in plan.spec.nodes:
        node_type = registry.node_types.get(node.plugin)
        if node_type is None:
            plan.problem(node.name, "unknown-plugin", f"no node type {node.plugin!r} is registered",
                         f"{did_you_mean(node.plugin, registry.node_types)} (`draftflow plugins` lists them)",
                         where=plan.spec.at("nodes", node.name, "plugin"))
            continue
        dirs = {key: plan.spec.dir_of("nodes", node.name, "params", key) for key in node.params}
        params, issues = validate_params(node_type.params, node.params, plan.spec.base_dir, dirs)
        for field, message, fix in issues:
            plan.problems.append(Problem(node.name, "param", message, fix, node_type.name,
                                         plan.spec.at("nodes", node.name, "params", field)))
        if issues:
            plan.unresolved[node.name] = UnresolvedNode(node.name, node_type, params)
            continue
        try:
            manifest = node_type.manifest(params, plan.env)
        except DraftflowError as exc:  # the user's params or files: the plugin's message names them and the fix
            plan.problems.append(Problem(node.name, "manifest", str(exc), "", node_type.name, node.where))
            plan.unresolved[node.name] = UnresolvedNode(node.name, node_type, params)
            continue
        except OSError as exc:  # a file the params name cannot be read (a directory, permissions, a broken link)
            plan.problems.append(Problem(node.name, "manifest", _os_message(exc), "make the file readable or point params at another one",
                                         node_type.name, node.where))
            plan.unresolved[node.name] = UnresolvedNode(node.name, node_type, params)
            continue
        except Exception as exc:
            plan.problems.append(Problem(node.name, "invalid-manifest", f"plugin {node_type.plugin!r} could not declare a manifest: {type(exc).__name__}: {exc}",
                                         f"report this to the author of plugin {node_type.plugin!r}", node_type.name, node.where))
            continue
        if not isinstance(manifest, Manifest):
            plan.problems.append(Problem(node.name, "invalid-manifest", f"plugin {node_type.plugin!r} returned {type(manifest).__name__}, not a Manifest",
                                         f"report this to the author of plugin {node_type.plugin!r}", node_type.name, node.where))
            continue
        if manifest.role != node_type.role:
            plan.problems.append(Problem(node.name, "invalid-manifest", f"manifest role {manifest.role!r} differs from the registered role {node_type.role!r}",
                                         f"report this to the author of plugin {node_type.plugin!r}", node_type.name, node.where))
            continue
        plan.nodes[node.name] = ResolvedNode(node.name, node_type, params, manifest)


def _os_message(exc: OSError) -> str:
    """``path: reason`` for an OSError a plugin let through (e.g. 'Permission denied', 'Is a directory')."""
    what = exc.strerror or type(exc).__name__
    return f"{exc.filename}: cannot read it ({what})" if exc.filename else f"cannot read a file ({what}: {exc})"


def _wire(plan: GraphPlan) -> None:
    explicit: dict[tuple[str, str], list[EdgeSpec]] = {}
    for edge in plan.spec.edges:
        ok = True
        for end, node, port, kind in ((edge.src, edge.src, edge.src_port, "output"), (edge.dst, edge.dst, edge.dst_port, "input")):
            if plan.spec.node(node) is None:
                plan.problem("", "edge", f"edge '{edge.render()}' names node {node!r}, which is not in the graph",
                             did_you_mean(node, [n.name for n in plan.spec.nodes]), where=edge.where)
                ok = False
            elif node in plan.nodes:
                m = plan.nodes[node].manifest
                ports = m.outputs if kind == "output" else m.inputs
                if not any(p.name == port for p in ports):
                    plan.problem(node, "edge", f"edge '{edge.render()}': node has no {kind} port {port!r}",
                                 did_you_mean(port, [p.name for p in ports]), where=edge.where)
                    ok = False
            else:
                ok = False
        if not ok:
            continue
        src_port = plan.nodes[edge.src].manifest.output(edge.src_port)
        dst_port = plan.nodes[edge.dst].manifest.input(edge.dst_port)
        if src_port.type != dst_port.type:
            plan.problem(edge.dst, "port-type", f"edge '{edge.render()}' joins a {src_port.type!r} output to a {dst_port.type!r} input",
                         f"connect {edge.dst}.{edge.dst_port} to an output of type {dst_port.type!r}", where=edge.where)
            continue
        if dst_port.carried and not edge.carried:
            edge = attrs.evolve(edge, carried=True)
        explicit.setdefault((edge.dst, edge.dst_port), []).append(edge)
    for (dst, port), edges in sorted(explicit.items()):
        if len(edges) > 1:
            srcs = " and ".join(f"{e.src}.{e.src_port}" for e in edges)
            plan.problem(dst, "duplicate-producer", f"input {dst}.{port} is fed by both {srcs}",
                         _choose_fix(plan, dst, port), where=edges[1].where)
        plan.edges.append(edges[0])
    for name, resolved in plan.nodes.items():
        for port in resolved.manifest.inputs:
            if (name, port.name) in explicit or not (port.auto or port.required):
                continue
            producers = [(other, out) for other, r in plan.nodes.items() if other != name
                         for out in r.manifest.outputs if out.type == port.type]
            if len(producers) == 1:
                src, out = producers[0]
                plan.edges.append(EdgeSpec(src, out.name, name, port.name, port.carried, "auto"))
            elif len(producers) > 1:
                srcs = " and ".join(f"{s}.{o.name}" for s, o in producers)
                plan.problem(name, "duplicate-producer", f"input {name}.{port.name} ({port.type}) could be fed by {srcs}",
                             _choose_fix(plan, name, port.name))
            elif port.required and len(plan.nodes) == len(plan.spec.nodes):
                # With an unresolved node (already reported) a missing producer is likely its consequence.
                plan.problem(name, "missing-producer", f"required input {name}.{port.name} ({port.type}) has no producer",
                             f"add a node with a {port.type!r} output, or an edge '<node>.<port> -> {name}.{port.name}'")


def _choose_fix(plan: GraphPlan, node: str, port: str) -> str:
    fix = f"keep one edge into {node}.{port}"
    resolved = plan.nodes.get(node)
    if resolved is not None and resolved.manifest.input(port) and resolved.manifest.input(port).type == "proposal":
        return fix + f", or combine the drafters with a mixer node (plugin: mixer) and feed mix.proposal to {node}.{port}"
    return fix + " (write the edge explicitly)"


def _order(plan: GraphPlan) -> None:
    graph = plan.graph
    for name, r in plan.nodes.items():
        graph.add_node(name, role=r.manifest.role, plugin=r.node_type.name)
    for e in plan.edges:
        graph.add_edge(e.src, e.dst, carried=e.carried, label=f"{e.src_port}->{e.dst_port}")
    acyclic = nx.DiGraph((u, v) for u, v, d in graph.edges(data=True) if not d["carried"])
    acyclic.add_nodes_from(graph.nodes)
    if not nx.is_directed_acyclic_graph(acyclic):
        for cycle in nx.simple_cycles(acyclic):
            path = " -> ".join(cycle + [cycle[0]])
            plan.problem(cycle[0], "cycle", f"non-carried edges form a cycle: {path}",
                         "mark the edge that carries state to the next cycle as '(carried)', or remove it")
        plan.order = sorted(plan.nodes, key=lambda n: (ROLE_RANK[plan.nodes[n].manifest.role], n))
        return
    plan.order = list(nx.lexicographical_topological_sort(acyclic, key=lambda n: (ROLE_RANK[plan.nodes[n].manifest.role], n)))


def _collect_buffers(plan: GraphPlan) -> None:
    for name in plan.order:
        m = plan.nodes[name].manifest
        for b in m.owns:
            plan.buffers.setdefault(b.name, BufferInfo(b.name, [], [], [])).owners.append(name)
        for b in m.reads:
            plan.buffers.setdefault(b, BufferInfo(b, [], [], [])).readers.append(name)
        for b in m.writes:
            plan.buffers.setdefault(b, BufferInfo(b, [], [], [])).writers.append(name)

