"""`draftflow trace summarize`: statistics and plots from a --trace JSONL file."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from draftflow.core.errors import DraftflowError
from draftflow.core.plotting import check_image_output, pyplot, save_figure
from draftflow.core.tracing import CYCLE_FIELDS, RequestStats


MAX_LINE_BYTES = 1 << 20  # an event is well under 1 KiB; a longer line is not a trace line (and is not read whole)

# The fields `summarize` reads, with their types: a trace from elsewhere fails on its first odd line, by name.
_INT, _NUMBER, _TOKENS, _ID = "an integer", "a finite number", "a list of token ids", "a string or integer"
_REQUIRED = {
    "draft_cycle": {"request_id": _ID, "draft": _TOKENS, "accepted": _INT, "emitted": _TOKENS},
    "request_done": {"tokens_per_s": _NUMBER, "ttft_s": _NUMBER},
}
_OPTIONAL = {"draft_cycle": {"draft_ms": _NUMBER, "verify_ms": _NUMBER, "commit_ms": _NUMBER},
             "request_done": {"prefill_ms": _NUMBER, "load_s": _NUMBER}}


def _is(value, kind: str) -> bool:
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    if kind == _INT:
        return is_int(value)
    if kind == _NUMBER:
        return (is_int(value) or isinstance(value, float)) and math.isfinite(value)
    if kind == _TOKENS:
        return isinstance(value, list) and all(is_int(t) for t in value)
    return is_int(value) or isinstance(value, str)


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_event(event: dict, where: str) -> None:
    kind = event["event"]
    for name, expected in _REQUIRED[kind].items():
        if name not in event:
            raise DraftflowError(f"{where}: {kind} event has no '{name}' field (it needs "
                                 f"{', '.join(_REQUIRED[kind])}); is this a draftflow trace?")
    for name, expected in {**_REQUIRED[kind], **_OPTIONAL[kind]}.items():
        if name in event and not _is(event[name], expected):
            raise DraftflowError(f"{where}: {kind} field '{name}' is {_short(event[name])}; expected {expected}")
    if kind == "draft_cycle" and not 0 <= event["accepted"] <= len(event["draft"]):
        raise DraftflowError(f"{where}: draft_cycle field 'accepted' is {event['accepted']} but the cycle drafted "
                             f"{len(event['draft'])} tokens; expected 0 to {len(event['draft'])}")


def _parse_line(raw: bytes, where: str, first: bool = False) -> dict | None:
    """One trace line as an event dict; None for a blank line or an event kind summarize does not read."""
    try:
        line = raw.decode("utf-8-sig" if first else "utf-8")  # an editor may have put a BOM first
    except UnicodeDecodeError as exc:
        raise DraftflowError(f"{where}: not UTF-8 text (byte {raw[exc.start]:#04x}); is this a draftflow trace "
                             "(JSON lines written by --trace)?") from None
    if not line.strip():
        return None
    try:
        event = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DraftflowError(f"{where}:{exc.colno}: not a JSON line ({exc.msg}); is this a draftflow trace?") from None
    except (ValueError, RecursionError) as exc:  # a number too long to convert, nesting past the recursion limit
        why = "nested too deeply" if isinstance(exc, RecursionError) else "a number too long to read"
        raise DraftflowError(f"{where}: not a trace line ({why}); is this a draftflow trace?") from None
    if not isinstance(event, dict):
        raise DraftflowError(f"{where}: a JSON {type(event).__name__} where a trace event (a JSON object) was "
                             "expected; is this a draftflow trace?")
    if event.get("event") not in _REQUIRED:
        return None
    _check_event(event, where)
    return event


def read_trace(path: Path | str) -> tuple[list[dict], list[dict]]:
    """Return (cycle events, request events); a malformed line is an error naming its number."""
    path = Path(path)
    if path.is_dir():
        raise DraftflowError(f"{path}: is a folder, not a trace file; pass the FILE.jsonl written by --trace")
    try:
        f = path.open("rb")
    except FileNotFoundError:
        raise DraftflowError(f"{path}: no such trace file; write one with `draftflow generate ... --trace {path}`") from None
    except OSError as exc:
        raise DraftflowError(f"{path}: cannot read the trace file: {exc.strerror}") from None
    cycles, requests, lineno = [], [], 0
    with f:
        while raw := f.readline(MAX_LINE_BYTES + 1):
            lineno += 1
            if len(raw.rstrip(b"\r\n")) > MAX_LINE_BYTES:
                raise DraftflowError(f"{path}:{lineno}: a line longer than {MAX_LINE_BYTES >> 20} MiB; trace events "
                                     "are short JSON lines; is this a draftflow trace?")
            event = _parse_line(raw, f"{path}:{lineno}", first=lineno == 1)
            if event is not None:
                (cycles if event["event"] == "draft_cycle" else requests).append(event)
    if lineno == 0:
        raise DraftflowError(f"{path}: the file is empty; a trace is written by `draftflow generate ... --trace {path}`")
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
        prefill = [r["prefill_ms"] for r in requests if "prefill_ms" in r]
        if prefill:
            out["mean_prefill_ms"] = round(sum(prefill) / len(prefill), 4)
        if "load_s" in requests[0]:  # once per process; every request repeats it
            out["load_s"], out["warmup_s"] = requests[0]["load_s"], requests[0].get("warmup_s")
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
        prefill = f" (prefill {summary['mean_prefill_ms']:.2f} ms)" if "mean_prefill_ms" in summary else ""
        lines.append(f"mean tokens/s {summary['mean_tokens_per_s']:.2f}, mean time to first token "
                     f"{summary['mean_ttft_s'] * 1000:.2f} ms{prefill}")
    if summary.get("load_s") is not None:
        warm = summary.get("warmup_s")
        lines.append(f"load {summary['load_s']:.2f} s, warm-up " + (f"{warm:.2f} s" if isinstance(warm, (int, float)) else "none"))
    return "\n".join(lines)


def plot(summary: dict, path: str, inputs: tuple = ()) -> None:
    """Draw the accept-length histogram and the per-position acceptance to an image at `path`."""
    check_image_output(path, "--plot", inputs)
    plt = pyplot("--plot")

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
    try:
        save_figure(fig, path, "--plot")
    finally:
        plt.close(fig)
