"""Test helpers for plugin authors: the greedy gate.

The greedy gate is the losslessness check every drafter must pass: at temperature 0 in
float32, a graph with the drafter produces exactly the tokens target-only decoding
produces. Target-only decoding is the same graph with every drafter/selector/mixer node
removed, so the target and verifier are the same objects of the same plugins.

    from draftflow.testing import greedy_gate
    report = greedy_gate("graphs/my-drafter.yaml", prompts=[[1, 2, 3]], max_new_tokens=64)
    assert report.accepted > 0   # the drafter did something
"""

from __future__ import annotations

from pathlib import Path

import attrs

from draftflow.core.executor import Executor, Result
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import Registry, load_registry
from draftflow.core.spec import GraphSpec, load_graph

KEEP_ROLES = ("target", "verifier")


@attrs.frozen
class GateReport:
    speculative: tuple[Result, ...]
    reference: tuple[Result, ...]

    @property
    def accepted(self) -> int:
        return sum(r.stats["accepted"] for r in self.speculative)

    @property
    def drafted(self) -> int:
        return sum(r.stats["drafted"] for r in self.speculative)


def target_only(spec: GraphSpec, registry: Registry) -> GraphSpec:
    """The same graph without drafters, selectors and mixers (only target and verifier kept)."""
    plan = build_plan(spec, registry)
    plan.raise_if_problems()
    keep = {n for n, r in plan.nodes.items() if r.manifest.role in KEEP_ROLES}
    return attrs.evolve(spec, name=spec.name + "-target-only", num_draft=0,
                        nodes=tuple(n for n in spec.nodes if n.name in keep),
                        edges=tuple(e for e in spec.edges if e.src in keep and e.dst in keep))


def run(spec: GraphSpec, registry: Registry, prompts, sampling: SamplingParams) -> tuple[Result, ...]:
    plan = build_plan(spec, registry)
    plan.raise_if_problems()
    ex = Executor(plan, hook=registry.pm.hook)
    return tuple(ex.generate(list(p), sampling) for p in prompts)


def greedy_gate(graph: GraphSpec | str | Path, prompts, max_new_tokens: int = 64, registry: Registry | None = None,
                overrides=(), ignore_eos: bool = True) -> GateReport:
    """Run ``graph`` and its target-only twin greedily in float32; raise AssertionError on any difference."""
    registry = registry or load_registry()
    spec = graph if isinstance(graph, GraphSpec) else load_graph(graph, list(overrides))
    if spec.dtype != "float32":
        spec = attrs.evolve(spec, dtype="float32")
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    spec_out = run(spec, registry, prompts, sampling)
    ref_out = run(target_only(spec, registry), registry, prompts, sampling)
    for i, (a, b) in enumerate(zip(spec_out, ref_out)):
        if a.token_ids != b.token_ids:
            pos = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), min(len(a.token_ids), len(b.token_ids)))
            raise AssertionError(f"greedy gate failed for prompt {i}: speculative output differs from target-only at "
                                 f"token {pos}: {list(a.token_ids[pos:pos + 5])} vs {list(b.token_ids[pos:pos + 5])}")
    return GateReport(spec_out, ref_out)
