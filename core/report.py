"""Human-readable rendering of a checked plan: order, edges, buffers, the VRAM table."""

from __future__ import annotations

import torch

from draftflow.core.budget import fmt_bytes
from draftflow.core.plan import GraphPlan
from draftflow.core.plotting import check_image_output, pyplot, save_figure
from draftflow.layers.gguf_quants import weight_lines
from draftflow.layers.quant_linear import keeps_quantized


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)] if rows else [len(h) for h in headers]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    return ["  " + fmt.format(*headers).rstrip()] + ["  " + fmt.format(*map(str, r)).rstrip() for r in rows]


def render_plan(plan: GraphPlan) -> str:
    spec = plan.spec
    lines = [f"graph {spec.name} ({spec.source}): OK", f"device {spec.device}, dtype {spec.dtype}, num_draft {spec.num_draft}",
             *(f"per_device {line}" for line in spec.per_device), ""]
    lines.append("execution order: " + " -> ".join(f"{n} [{plan.nodes[n].node_type.name}, {plan.nodes[n].manifest.role}]" for n in plan.order))
    lines.append("")
    lines.append("edges:")
    for e in sorted(plan.edges):
        lines.append(f"  {e.render()}" + ("  (auto-wired)" if e.where == "auto" else ""))
    if plan.buffers:
        lines.append("")
        lines.append("buffers:")
        rows = [[b.name, ",".join(b.owners) or "-", ",".join(b.readers) or "-", fmt_bytes(b.nbytes)] for b in plan.buffers.values()]
        lines += _table(["name", "owner", "readers", "bytes"], rows)
    if plan.vram is not None:
        v = plan.vram
        lines.append("")
        if spec.tensor_parallel > 1:  # a sharding target declared one rank's share; every rank holds the rest whole
            lines.append(f"VRAM plan per rank, tensor_parallel {spec.tensor_parallel} (budget {fmt_bytes(v.budget)} "
                         "per GPU; the target's layers and KV cache are one rank's shard, other nodes whole):")
        else:
            lines.append(f"VRAM plan (budget {fmt_bytes(v.budget)}):")
        cols = ["weights", "kv", "scratch"] + (["experts"] if v.experts is not None else [])
        rows = [[r.node] + [fmt_bytes(getattr(r, c)) for c in cols] + [fmt_bytes(r.total)] for r in v.rows]
        rows.append(["total"] + [fmt_bytes(sum(getattr(r, c) for r in v.rows)) for c in cols] + [fmt_bytes(v.total)])
        lines += _table(["node", *cols, "total"], rows)
        if v.kv_tokens is not None:
            lines.append(f"  KV cache: {v.kv_tokens} tokens per request (limited by {v.kv_limit_reason})")
            fits = "" if v.batch_fits is None else f"; {v.batch_fits} requests of {v.kv_tokens} tokens fit the budget"
            lines.append(f"  request slots: {v.batch} ({v.batch_reason}){fits}")
        if v.experts is not None:
            lines.append("  " + expert_cache_line(plan))
    for n in plan.by_role("target"):  # a GGUF target: its tensor types per group, dequantized at load or kept
        info = plan.nodes[n].manifest.target  # TargetInfo
        keep = keeps_quantized(spec.device, plan.nodes[n].params.get("quantized", False), spec.tensor_parallel)
        lines += ["  " + line for line in weight_lines(info.path, getattr(torch, spec.dtype), keep)] if info is not None else []
    return "\n".join(lines)


def expert_cache_line(plan: GraphPlan) -> str:
    """`expert cache: 412 of 768 experts resident (...); the dflash drafter costs 63 of them`."""
    e = plan.vram.experts
    text = (f"expert cache: {e.resident} of {e.total} experts resident ({fmt_bytes(e.bytes_per_expert)} each; "
            f"{e.reason})")
    costs = [f"the {plan.nodes[n].node_type.name} {plan.nodes[n].manifest.role} ('{n}') costs {c} of them"
             for n, c in e.costs if n in plan.nodes and plan.nodes[n].manifest.role != "verifier"]
    return text + ("; " + ", ".join(costs) if costs else "")


ROLE_COLORS = {"target": "#8ecae6", "drafter": "#ffb703", "selector": "#fb8500", "verifier": "#90be6d",
               "policy": "#cdb4db", "other": "#cccccc"}


def draw_plan(plan: GraphPlan, path: str) -> None:
    """Render the graph to an image: solid arrows within a cycle, dashed for carried edges."""
    import networkx as nx

    check_image_output(path, "--draw", inputs=(plan.spec.source,))
    plt = pyplot("--draw")

    g = plan.graph
    layers = {n: i for i, n in enumerate(plan.order)}
    pos = {n: (layers[n], (i % 2) * 0.6) for i, n in enumerate(plan.order)}
    fig, ax = plt.subplots(figsize=(2.6 * max(len(g), 2), 3.2))
    colors = ROLE_COLORS
    nx.draw_networkx_nodes(g, pos, ax=ax, node_size=2600, node_color=[colors[plan.nodes[n].manifest.role] for n in g])
    nx.draw_networkx_labels(g, pos, ax=ax, labels={n: f"{n}\n{plan.nodes[n].node_type.name}" for n in g}, font_size=8)
    solid = [(u, v) for u, v, d in g.edges(data=True) if not d["carried"]]
    dashed = [(u, v) for u, v, d in g.edges(data=True) if d["carried"]]
    nx.draw_networkx_edges(g, pos, ax=ax, edgelist=solid, node_size=2600, arrowsize=16)
    nx.draw_networkx_edges(g, pos, ax=ax, edgelist=dashed, node_size=2600, arrowsize=16, style="dashed",
                           connectionstyle="arc3,rad=0.35")
    nx.draw_networkx_edge_labels(g, pos, ax=ax, edge_labels={(u, v): d["label"] for u, v, d in g.edges(data=True) if not d["carried"]},
                                 font_size=7)
    nx.draw_networkx_edge_labels(g, pos, ax=ax, edge_labels={(u, v): d["label"] for u, v, d in g.edges(data=True) if d["carried"]},
                                 font_size=7, connectionstyle="arc3,rad=0.35")
    ax.margins(x=0.08, y=0.45)  # room for the carried arcs above the nodes
    ax.set_title(f"{plan.spec.name}: dashed = carried to the next cycle")
    ax.axis("off")
    fig.tight_layout()
    try:
        save_figure(fig, path, "--draw")
    finally:
        plt.close(fig)
