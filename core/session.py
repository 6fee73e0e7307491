"""A Session ties the pieces together for the CLI and for library users:
registry -> graph spec -> checked plan -> executor (+ trace sinks)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from draftflow.core.errors import DraftflowError, SpecError
from draftflow.core.executor import Executor, Result
from draftflow.core.node import SamplingParams
from draftflow.core.plan import GraphPlan, build_plan
from draftflow.core.registry import Registry, load_registry
from draftflow.core.spec import GraphSpec, apply_overrides, load_graph
from draftflow.core.tracing import JsonlSink


def shortcut_graph(args) -> dict:
    """The graph that `generate --target ... [--lookup] [--mtp] [--dflash ...]` stands for, as a YAML-shaped dict.

    Several drafters are combined by a `mixer` node in order of preference: prompt lookup
    (free when it matches), then DFlash2, DFlash, MTP.
    """
    target = {"plugin": "target", "params": {"path": args.target}}
    nodes = {"target": target}
    drafters = []
    if args.lookup:
        drafters.append(("lookup", {"plugin": "prompt-lookup", "params": {}}))
    if args.dflash2:
        # The DFlash2 drafter emits candidates; its selector node produces the proposal.
        nodes["dflash2"] = {"plugin": "dflash2", "params": {"path": args.dflash2}}
        drafters.append(("selector", {"plugin": "dflash2-selector", "params": {}}))
    if args.dflash:
        drafters.append(("dflash", {"plugin": "dflash", "params": {"path": args.dflash}}))
    if args.mtp is not None:
        drafters.append(("mtp", {"plugin": "mtp", "params": {"path": args.mtp or args.target}}))
        # The MTP head reads the target's final hidden state: tap the last layer.
        from draftflow.plugins.target.plugin import read_any_config

        try:
            target["params"]["tap_layers"] = [read_any_config(args.target).num_layers - 1]
        except DraftflowError:
            pass  # the target node reports the unreadable path itself
    if args.dflash or args.dflash2:
        # DFlash drafters condition on the target's hidden states at their trained tap layers.
        from draftflow.plugins.dflash.loader import read_config as read_dflash_config

        try:
            taps = list(read_dflash_config(args.dflash or args.dflash2).target_layer_ids)
            taps += [t for t in target["params"].get("tap_layers", []) if t not in taps]  # MTP's last layer
            target["params"]["tap_layers"] = taps
        except DraftflowError:
            pass  # the drafter node reports the unreadable artifact itself
    nodes.update(drafters)
    nodes["verify"] = {"plugin": "verifier", "params": {}}
    graph = {"name": "generate", "nodes": nodes, "edges": []}
    if len(drafters) > 1:
        ports = [chr(ord("a") + i) for i in range(len(drafters))]
        nodes["mix"] = {"plugin": "mixer", "params": {"inputs": ports}}
        graph["edges"] = [f"{name}.proposal -> mix.{port}" for (name, _), port in zip(drafters, ports)]
        graph["edges"] += ["mix.proposal -> target.proposal", "mix.proposal -> verify.proposal"]
    return graph


class Session:
    def __init__(self, registry: Registry, plan: GraphPlan, executor: Executor, sink: JsonlSink | None):
        self.registry, self.plan, self.executor, self.sink = registry, plan, executor, sink

    @staticmethod
    def shipped_graph(name: str) -> Path:
        path = Path(str(resources.files("draftflow.graphs").joinpath(name)))
        if not path.exists():
            raise DraftflowError(f"the shipped graph {name} is missing from the installation; reinstall draftflow")
        return path

    @staticmethod
    def load_spec(graph_path: Path | None = None, graph_dict: dict | None = None, overrides=()) -> GraphSpec:
        if graph_path is not None:
            return load_graph(graph_path, list(overrides))
        if graph_dict is None:
            raise SpecError("no graph: pass a graph file or --target")
        return GraphSpec.from_dict(apply_overrides(graph_dict, list(overrides)), source="<command line>", base_dir=Path.cwd())

    @classmethod
    def plan_only(cls, graph_path: Path | None = None, overrides=(), graph_dict: dict | None = None, registry: Registry | None = None) -> GraphPlan:
        registry = registry or load_registry()
        return build_plan(cls.load_spec(graph_path, graph_dict, overrides), registry)

    @classmethod
    def open(cls, graph_path: Path | None = None, graph_dict: dict | None = None, overrides=(), trace: str | None = None,
             registry: Registry | None = None) -> "Session":
        """Check the graph (every problem at once), then allocate and build the nodes."""
        registry = registry or load_registry()
        plan = build_plan(cls.load_spec(graph_path, graph_dict, overrides), registry)
        plan.raise_if_problems()
        sink = JsonlSink(trace) if trace else None
        if sink is not None:
            registry.pm.register(sink, name=f"trace-jsonl:{trace}")
        return cls(registry, plan, Executor(plan, hook=registry.pm.hook), sink)

    @property
    def tokenizer(self):
        return getattr(self.executor.nodes[self.executor.target], "tokenizer", None)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise DraftflowError("the target has no tokenizer (no tokenizer.json or GGUF vocabulary); pass --prompt-ids 1,2,3")
        return list(self.tokenizer.encode(text))

    def generate(self, prompt_ids: list[int], sampling: SamplingParams | None = None, request_id: str | None = None) -> Result:
        return self.executor.generate(prompt_ids, sampling, request_id)

    def close(self) -> None:
        if self.sink is not None:
            self.registry.pm.unregister(self.sink)
            self.sink.close()
