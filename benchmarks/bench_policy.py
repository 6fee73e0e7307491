"""A policy node for benchmarks: every cycle drafts `FixedK.k` (set by the benchmark between measurements)."""

from __future__ import annotations

from draftflow.plugin import Manifest, Node, NodeType, hookimpl


class FixedK(Node):
    k = 0

    def choose_draft(self, batch) -> int:
        return min(FixedK.k, batch.num_draft)


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(name="bench-k", role="policy", factory=FixedK,
                                    manifest=lambda params, env: Manifest(role="policy")))
