"""A Session ties the pieces together for the CLI and for library users:
graph spec -> registry -> checked plan -> executor (+ trace sinks).

The graph file is read before the registry loads plugins (and with them torch), so a YAML
or path error is reported in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import os
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from draftflow.core.errors import DraftflowError, PluginError, RequestError, SpecError
from draftflow.core.node import SamplingParams
from draftflow.core.spec import GraphSpec, load_graph, resolve_graph
from draftflow.core.yamlio import Located
from draftflow.core.tracing import JsonlSink, check_trace_path

if TYPE_CHECKING:
    from draftflow.core.executor import Executor, Result
    from draftflow.core.plan import GraphPlan
    from draftflow.core.registry import Registry

# A CPU target smaller than this runs fastest on one thread: its matmuls are too small to
# split, and every extra thread adds wake-ups that, when the cores are shared, cost more than
# the whole step (2-core machine, demo target of 4 MiB: 1 thread 500-1060 tok/s, 2 threads
# 5-35; the issue's idle run: 912 on 1 thread, 800-900 on 2). Bigger targets get the
# physical cores; on a shared machine pass --threads 1 (100M params, 2 busy cores: 1 thread
# 14-31 tok/s, 2 threads 6-10). The size counts as float32 (4 bytes a weight): what the rule
# weighs is the products' work, which a 16-bit graph does not halve (the 17M demo target in
# bfloat16, 34 MB, HumanEval 12 prompts: 1 thread 88.5 / DFlash 147.8 tok/s, 2 threads 120.0 /
# 210.8, docs/BENCHMARKS.md 2026-12-04).
SMALL_TARGET_BYTES = 64 << 20


def physical_cores() -> int:
    """CPU cores this process may run on, counting the hyper-threads of one core once."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def default_threads(device_type: str, target_bytes: int, itemsize: int = 4) -> int:
    """Torch threads when neither --threads nor OMP_NUM_THREADS says: 1 for a small CPU target (its bytes at
    `itemsize` per value, counted as float32), else the physical cores."""
    if device_type == "cpu" and target_bytes * 4 // itemsize < SMALL_TARGET_BYTES:
        return 1
    return physical_cores()


def check_threads(threads: int | None) -> None:
    if threads is not None and threads < 1:
        raise DraftflowError(f"--threads {threads}: it must be at least 1 (leave it out for the default)")


def shortcut_graph(args, registry: Registry | None = None) -> dict:
    """The graph that `generate --target ... [--lookup] [--mtp] [--dflash ...]` stands for, as a YAML-shaped dict.

    Several drafters are combined by a `mixer` node in order of preference: prompt lookup
    (free when it matches), then DFlash2, DFlash, MTP. Paths are used as given: the CLI has
    made them absolute (relative to the working directory). What a drafter needs of the
    target (DFlash: its trained tap layers; MTP: the last layer) is asked of the plugins
    through ``draftflow_target_params``, and graph-level defaults (DFlash: num_draft =
    block_size - 1, the shape it was trained on) through ``draftflow_shortcut_defaults``;
    core knows no plugin. `--spec` / `--set` are overrides applied to this dict later: they win.
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
    nodes.update(drafters)
    if len(nodes) > 1:
        if registry is None:
            from draftflow.core.registry import load_registry

            registry = load_registry()
        drafter_nodes = [n for name, n in nodes.items() if name != "target"]
        _merge_target_params(target["params"], drafter_nodes, registry)
        defaults = _shortcut_defaults(drafter_nodes, registry)
    else:
        defaults = {}
    nodes["verify"] = {"plugin": "verifier", "params": {}}
    graph = {"name": "generate", **defaults, "nodes": nodes, "edges": []}
    if len(drafters) > 1:
        ports = [chr(ord("a") + i) for i in range(len(drafters))]
        nodes["mix"] = {"plugin": "mixer", "params": {"inputs": ports}}
        graph["edges"] = [f"{name}.proposal -> mix.{port}" for (name, _), port in zip(drafters, ports)]
        graph["edges"] += ["mix.proposal -> target.proposal", "mix.proposal -> verify.proposal"]
    return graph


def _merge_target_params(params: dict, nodes: list[dict], registry: Registry) -> None:
    """Ask every plugin what each node needs of the target; lists are unioned in order, the first scalar wins.

    A target or drafter whose files cannot be read gets no answer: its own node reports that in `check`.
    """
    from draftflow.core.params import validate_params

    info = None
    node_type = registry.node_types.get("target")
    if node_type is not None and node_type.target_info is not None:
        full, issues = validate_params(node_type.params, params, Path.cwd())
        if not issues:
            try:
                info = node_type.target_info(full)
            except (DraftflowError, OSError):
                info = None
    for node in nodes:
        for answer in _ask(registry, "draftflow_target_params", node, target=info):
            for key, value in answer.items():
                if isinstance(value, (list, tuple)):
                    have = list(params.get(key) or [])
                    params[key] = have + [v for v in value if v not in have]
                else:
                    params.setdefault(key, value)


def _ask(registry: Registry, hook: str, node: dict, **kwargs) -> list[dict]:
    """A compose hook's answers for one shortcut-graph node (dicts; None answers dropped).

    A ``DraftflowError``/``OSError`` (unreadable files) means no answer: the node's own check
    reports it. A crash or a non-dict answer is a plugin bug: one ``PluginError`` line.
    """
    where = f"{hook} for a {node['plugin']!r} node"
    try:
        answers = getattr(registry.pm.hook, hook)(plugin=node["plugin"], params=dict(node["params"]), **kwargs)
    except (DraftflowError, OSError):
        return []
    except Exception as exc:  # a plugin's bug: name the hook, not a traceback
        raise PluginError(f"a plugin failed in {where}: {type(exc).__name__}: {exc}; "
                          "report it to the plugin's author") from exc
    for answer in filter(None, answers):
        if not isinstance(answer, dict):
            raise PluginError(f"a plugin answered {where} with {type(answer).__name__}, not a dict; "
                              "report it to the plugin's author")
    return [a for a in answers if a]


# Graph-level keys a plugin may default in a shortcut graph (draftflow_shortcut_defaults).
SHORTCUT_DEFAULT_KEYS = ("num_draft",)


def _shortcut_defaults(nodes: list[dict], registry: Registry) -> dict:
    """Ask every plugin for graph-level defaults per drafter node; for each key the largest answer wins.

    The largest, because a mixer drafts one K for all its inputs: lookup (no answer) and
    DFlash together get DFlash's trained block, which lookup can always fill or shorten.
    """
    out: dict = {}
    for node in nodes:
        where = f"draftflow_shortcut_defaults for a {node['plugin']!r} node"
        for answer in _ask(registry, "draftflow_shortcut_defaults", node):
            for key, value in answer.items():
                if key not in SHORTCUT_DEFAULT_KEYS or isinstance(value, bool) or not isinstance(value, int):
                    raise PluginError(f"a plugin answered {where} with {key}={value!r}; only integer "
                                      f"{' / '.join(SHORTCUT_DEFAULT_KEYS)} may be defaulted; report it to the plugin's author")
                out[key] = max(out.get(key, value), value)
    return out


class Session:
    def __init__(self, registry: Registry, plan: GraphPlan, executor: Executor, sink: JsonlSink | None,
                 threads: int | None = None):
        self.registry, self.plan, self.executor, self.sink = registry, plan, executor, sink
        self.threads = threads  # torch intra-op threads this session set (None: left as they were)

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
        loc = Located("<command line>")  # errors about a --set value then name that --set
        data, taken = resolve_graph(graph_dict, list(overrides), located=loc)
        return GraphSpec.from_dict(data, source="<command line>", located=loc, base_dir=Path.cwd(), per_device=taken)

    @classmethod
    def plan_only(cls, graph_path: Path | None = None, overrides=(), graph_dict: dict | None = None, registry: Registry | None = None) -> GraphPlan:
        spec = cls.load_spec(graph_path, graph_dict, overrides)  # YAML errors before plugins (and torch) load
        from draftflow.core.plan import build_plan
        from draftflow.core.registry import load_registry

        return build_plan(spec, registry or load_registry())

    @classmethod
    def open(cls, graph_path: Path | None = None, graph_dict: dict | None = None, overrides=(), trace: str | None = None,
             registry: Registry | None = None, threads: int | None = None) -> "Session":
        """Check the graph (every problem at once), then allocate and build the nodes, then warm them up.

        The executor records both times (``load_s``, ``warmup_s``); every request's stats repeat them.

        ``threads``: torch intra-op threads; None picks them (``default_threads``) unless
        OMP_NUM_THREADS is set, which is then left in charge.
        """
        check_threads(threads)
        graph_input = [(graph_path, "the graph file")] if graph_path is not None else []
        if trace:  # a missing folder or the graph file itself, reported before anything loads
            check_trace_path(trace, graph_input)
        spec = cls.load_spec(graph_path, graph_dict, overrides)  # YAML errors before plugins (and torch) load
        from draftflow.core import mirror
        from draftflow.core.plan import build_plan
        from draftflow.core.registry import load_registry

        if spec.tensor_parallel > 1:  # one process per rank (docs/TENSOR_PARALLEL.md)
            spec = mirror.rank_spec(spec)
        registry = registry or load_registry()
        plan = build_plan(spec, registry)
        plan.raise_if_problems()
        trace_path = check_trace_path(trace, graph_input + cls.inputs(plan)) if trace else None
        executor = mirror.make_executor(plan, hook=registry.pm.hook)
        if threads is None and "OMP_NUM_THREADS" not in os.environ:
            threads = default_threads(executor.device.type, executor.measured.get(executor.target, 0),
                                      executor.dtype.itemsize)
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        executor.warmup()  # before any request (and with the threads it will run on): graphs, kernels
        if executor.tp is not None and not executor.tp.is_leader:  # ranks > 0 mirror rank 0 until it closes
            mirror.follow(executor)
            raise mirror.FollowerDone()
        sink = None
        if trace_path is not None:  # opened (truncated) only once everything loaded
            sink = JsonlSink(trace_path)
            registry.pm.register(sink, name=f"trace-jsonl:{trace}")
        return cls(registry, plan, executor, sink, threads)

    @staticmethod
    def inputs(plan: GraphPlan) -> list[tuple[Path, str]]:
        """Files and folders the nodes read: every path param of every node."""
        out = []
        for name, node in plan.nodes.items():
            for spec in node.node_type.params:
                value = node.params.get(spec.name)
                if spec.type == "path" and value:
                    out.append((Path(value), f"node '{name}' param '{spec.name}'"))
        return out

    @property
    def tokenizer(self):
        return self.executor.handle.tokenizer

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise DraftflowError("the target has no tokenizer (no tokenizer.json or GGUF vocabulary); pass --prompt-ids 1,2,3")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # bytes that were not UTF-8 (argv's surrogateescape) or a JSON "\udcff"
            code = ord(text[exc.start])
            what = f"the byte 0x{code - 0xDC00:02x}, which is not UTF-8" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
            raise RequestError(f"the prompt is not valid text: character {exc.start} is {what}; pass UTF-8 text") from None
        return list(self.tokenizer.encode(text))

    def generate(self, prompt_ids: list[int], sampling: SamplingParams | None = None, request_id: str | None = None) -> Result:
        return self.executor.generate(prompt_ids, sampling, request_id)

    @contextlib.contextmanager
    def untraced(self):
        """Requests run inside it are not written to the trace file (generate --compare's repeated rounds)."""
        if self.sink is None:
            yield
            return
        name = self.registry.pm.get_name(self.sink)
        self.registry.pm.unregister(self.sink)
        try:
            yield
        finally:
            self.registry.pm.register(self.sink, name=name)

    def close(self) -> None:
        if hasattr(self.executor, "close"):  # tensor parallelism: release the other ranks
            self.executor.close()
        if self.sink is not None:
            self.registry.pm.unregister(self.sink)
            self.sink.close()
