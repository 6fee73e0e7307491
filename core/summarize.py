"""`draftflow trace summarize`: statistics and plots from a --trace JSONL file."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from draftflow.core.errors import DraftflowError
from draftflow.core.tracing import CYCLE_FIELDS, RequestStats


def read_trace(path: Path | str) -> tuple[list[dict], list[dict]]:
    """Return (cycle events, request events); a malformed line is an error naming its number."""
    path = Path(path)
    if not path.exists():
        raise DraftflowError(f"{path}: no such trace file; write one with `draftflow generate ... --trace {path}`")
    cycles, requests = [], []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DraftflowError(f"{path}:{lineno}: not a JSON line ({exc.msg}); is this a draftflow trace?") from None
            kind = event.get("event") if isinstance(event, dict) else None
            if kind == "draft_cycle":
                cycles.append(event)
            elif kind == "request_done":
                requests.append(event)
    if not cycles:
        raise DraftflowError(f"{path}: no draft_cycle events; is this a draftflow trace?")
    return cycles, requests


def summarize(cycles: list[dict], requests: list[dict]) -> dict:
    stats = RequestStats()
    for c in cycles:
        stats.add(len(c["draft"]), c["accepted"], len(c["emitted"]))
    out = stats.summary()
    out["requests"] = len({c["request_id"] for c in cycles})
    out["tokens"] = sum(len(c["emitted"]) for c in cycles)
    out["accept_length_histogram"] = dict(sorted(Counter(len(c["emitted"]) for c in cycles).items()))
    for key in ("draft_ms", "verify_ms", "commit_ms"):
        out[f"mean_{key}"] = round(sum(c.get(key, 0.0) for c in cycles) / len(cycles), 4)
    # Node-contributed numeric fields (Node.cycle_fields, e.g. the MoE target's expert counters): totals.
    extra = sorted({k for c in cycles for k, v in c.items() if k not in CYCLE_FIELDS and k not in ("event", "level",
                    "timestamp") and isinstance(v, (int, float)) and not isinstance(v, bool)})
    if extra:
        out["node_field_totals"] = {k: sum(c.get(k, 0) for c in cycles) for k in extra}
    if requests:
        out["mean_tokens_per_s"] = round(sum(r["tokens_per_s"] for r in requests) / len(requests), 3)
        out["mean_ttft_s"] = round(sum(r["ttft_s"] for r in requests) / len(requests), 6)
    return out


def render(summary: dict) -> str:
    lines = [
        f"requests {summary['requests']}, cycles {summary['cycles']}, tokens {summary['tokens']}",
        f"tau (mean emitted per cycle) {summary['tau']:.3f}",
        f"acceptance rate {summary['acceptance_rate']:.3f} ({summary['accepted']}/{summary['drafted']} drafts)",
        "per-position acceptance " + " ".join(f"{p:.2f}" for p in summary["per_position_acceptance"]),
        "accept-length histogram " + ", ".join(f"{k}: {v}" for k, v in summary["accept_length_histogram"].items()),
        f"mean ms per cycle: draft {summary['mean_draft_ms']:.3f}, verify {summary['mean_verify_ms']:.3f}, commit {summary['mean_commit_ms']:.3f}",
    ]
    totals = summary.get("node_field_totals", {})
    if "expert_hits" in totals and "expert_misses" in totals:
        seen = totals["expert_hits"] + totals["expert_misses"]
        lines.append(f"expert cache: {totals['expert_hits']} hits, {totals['expert_misses']} misses (hit rate "
                     f"{totals['expert_hits'] / max(seen, 1):.3f}), {totals.get('expert_upload_bytes', 0) / 2**20:.1f} MiB uploaded")
    elif totals:
        lines.append("node fields (summed) " + ", ".join(f"{k} {v}" for k, v in totals.items()))
    if "mean_tokens_per_s" in summary:
        lines.append(f"mean tokens/s {summary['mean_tokens_per_s']:.2f}, mean time to first token {summary['mean_ttft_s'] * 1000:.2f} ms")
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    hist = summary["accept_length_histogram"]
    a.bar([int(k) for k in hist], list(hist.values()), color="#219ebc")
    a.set_xlabel("tokens emitted per cycle (acceptance length)")
    a.set_ylabel("cycles")
    a.set_title(f"tau = {summary['tau']:.2f}")
    pos = summary["per_position_acceptance"]
    b.bar(range(1, len(pos) + 1), pos, color="#fb8500")
    b.set_ylim(0, 1)
    b.set_xlabel("draft position")
    b.set_ylabel("acceptance")
    b.set_title(f"acceptance rate = {summary['acceptance_rate']:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
