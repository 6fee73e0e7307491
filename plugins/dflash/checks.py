"""Graph checks shared by the block drafters (`dflash`, `dflash2`): each factory takes the node type's name.

They read only the plan (nodes, their params, edges), as a third-party plugin's checks would.
"""

from __future__ import annotations

from draftflow.plugin import Problem


def tap_layer_check(kind: str, layer_ids):
    """A check that every `kind` node's target_layer_ids (``layer_ids(path)``) equal the target's tap_layers, in order."""

    def check(plan):
        targets = [n for n in plan.by_role("target") if "tap_layers" in plan.nodes[n].params]
        for name, node in plan.nodes.items():
            if node.node_type.name != kind or not targets:
                continue
            ids = tuple(layer_ids(node.params["path"]))
            target = targets[0]
            taps = tuple(plan.nodes[target].params["tap_layers"])
            if taps != ids:
                yield Problem(name, f"{kind}-taps", f"the drafter reads target layers {list(ids)} but target '{target}' "
                              f"taps {list(taps)}", f"set nodes.{target}.tap_layers={list(ids)}", kind,
                              plan.spec.node(name).where if plan.spec.node(name) else "")

    return check


def defer_check(kind: str):
    """A check that every `kind` node deferring to a proposal (its `defer` input) defers from the draft count at
    which a `first-nonempty` mixer takes that proposal instead (`defer_min` == the mixer's `min_tokens`).

    Below it, cycles where the other proposal is too short for the mixer draft nothing at all; above it, the block
    drafted in cycles the mixer gives to the other proposal is thrown away. A proposal deferred to that feeds
    nothing but `defer` inputs is a problem too: its cycles would verify no drafts.
    """

    def check(plan):
        for name, node in plan.nodes.items():
            if node.node_type.name != kind:
                continue
            for edge in (e for e in plan.inputs_of(name) if e.dst_port == "defer"):
                need = node.params["defer_min"]
                if not any((e.src, e.src_port) == (edge.src, edge.src_port) and e.dst_port != "defer" for e in plan.edges):
                    yield Problem(name, f"{kind}-defer", f"defers to {edge.src}.{edge.src_port}, which feeds nothing "
                                  f"else: a cycle where it offers {need} or more drafts verifies none",
                                  f"wire {edge.src}.{edge.src_port} into a mixer ahead of this drafter (docs/DFLASH.md, "
                                  f"defer), or drop the edge {edge.src}.{edge.src_port} -> {name}.defer", kind,
                                  edge.where or (plan.spec.node(name).where if plan.spec.node(name) else ""))
                    continue
                for mix, mixer in plan.nodes.items():
                    if mixer.node_type.name != "mixer" or mixer.params.get("policy") != "first-nonempty":
                        continue
                    ports = [e.dst_port for e in plan.inputs_of(mix) if (e.src, e.src_port) == (edge.src, edge.src_port)]
                    take = mixer.params["min_tokens"]
                    if not ports or ports[0] == mixer.params["inputs"][-1] or need == take:
                        continue  # not the mixer's preferred input (the last one is its fallback), or consistent
                    span = f"{min(need, take)}" + (f"-{max(need, take) - 1}" if abs(need - take) > 1 else "")
                    span += " draft" if span == "1" else " drafts"
                    if need < take:
                        what = (f"drafts nothing in cycles where '{edge.src}' offers {span}, which mixer '{mix}' "
                                f"does not take (its min_tokens is {take}): those cycles verify no drafts")
                    else:
                        what = (f"drafts in cycles where '{edge.src}' offers {span}, which mixer '{mix}' takes "
                                f"instead (its min_tokens is {take}): that block is thrown away")
                    yield Problem(name, f"{kind}-defer", f"defer_min {need} {what}",
                                  f"set nodes.{name}.params.defer_min={take} (or nodes.{mix}.params.min_tokens={need})",
                                  kind, plan.spec.node(name).where if plan.spec.node(name) else "")

    return check
