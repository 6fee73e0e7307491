"""Tracing: one ``draft_cycle`` event per cycle and one ``request_done`` event per request.

Events go to structlog (console renderer on a TTY, JSON lines otherwise) and to every
trace sink plugin through the ``draftflow_cycle_event`` / ``draftflow_request_event``
hooks. ``JsonlSink`` is the sink behind ``--trace FILE.jsonl``. Field meanings are in
docs/TRACING.md.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Iterable

import attrs
import structlog

from draftflow.core.errors import DraftflowError
from draftflow.core.hookspecs import hookimpl

log = structlog.get_logger("draftflow")

CYCLE_FIELDS = ("request_id", "cycle", "position", "anchor", "draft", "accepted", "emitted",
                "draft_ms", "verify_ms", "commit_ms", "batch", "k")
REQUEST_FIELDS = ("request_id", "tokens", "cycles", "drafted", "accepted", "tau", "acceptance_rate",
                  "per_position_acceptance", "tokens_per_s", "ttft_s", "prefill_ms", "load_s", "warmup_s", "finish_reason")


def configure_logging(verbose: bool = False, json_lines: bool | None = None) -> None:
    """Set up structlog for the CLI: INFO (cycle events) with -v, WARNING otherwise; logs go to stderr."""
    if json_lines is None:
        json_lines = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    # JSON lines carry an event's exc_info as its formatted traceback ("exception"); the console renderer does its own
    exc_info = [structlog.processors.format_exc_info] if json_lines else []
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso"), *exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO if verbose else logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


@attrs.define
class RequestStats:
    """Accumulates the per-request metrics (vLLM's definitions, see docs/TRACING.md)."""

    cycles: int = 0
    drafting_cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    accepted_at: list[int] = attrs.field(factory=list)  # cycles whose i-th draft was accepted
    proposed_at: list[int] = attrs.field(factory=list)  # cycles that proposed an i-th draft

    def add(self, num_draft: int, accepted: int, emitted: int) -> None:
        self.cycles += 1
        self.emitted += emitted
        self.drafted += num_draft
        self.accepted += accepted
        if num_draft:
            self.drafting_cycles += 1
        while len(self.proposed_at) < num_draft:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(num_draft):
            self.proposed_at[i] += 1
            self.accepted_at[i] += int(i < accepted)

    def summary(self) -> dict:
        return {
            "cycles": self.cycles,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tau": round(self.emitted / self.cycles, 4) if self.cycles else 0.0,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "per_position_acceptance": [round(a / p, 4) for a, p in zip(self.accepted_at, self.proposed_at)],
        }


def emit_cycle(hook, event: dict) -> None:
    _log("draft_cycle", event)
    hook.draftflow_cycle_event(event=event)


def emit_request(hook, event: dict) -> None:
    _log("request_done", event)
    hook.draftflow_request_event(event=event)


def _log(name: str, event: dict) -> None:
    """An event to structlog, only once someone configured it (the CLI and the server do, `configure_logging`; so
    does an application that uses structlog). Unconfigured, structlog would print every cycle to stdout: a program
    that drives a Session gets no output it did not ask for, and no formatting cost per cycle. Trace sinks (hooks,
    `--trace`) get every event either way."""
    if structlog.is_configured():
        log.info(name, **event)


def _is_trace(path: Path) -> bool:
    """Whether an existing file is empty or starts with a draftflow trace event (so overwriting it loses no input)."""
    try:
        with path.open("rb") as f:
            head = f.readline(1 << 16)
    except OSError:
        return True  # unreadable: the open for writing reports why
    if not head.strip():
        return True
    try:
        first = json.loads(head)
    except ValueError:
        return False
    return isinstance(first, dict) and first.get("event") in ("draft_cycle", "request_done")


def check_trace_path(path: Path | str, inputs: Iterable[tuple[Path | str, str]] = ()) -> Path:
    """The absolute path ``--trace`` may write, or a DraftflowError saying why not.

    ``inputs`` are (path, what) pairs the run reads: the trace may be neither one of them nor
    inside one (a model folder). An existing file is overwritten only if it is empty or already
    a trace: one trace file holds one run, so ``trace summarize`` never mixes runs.
    """
    p = Path(path).expanduser().absolute()
    flag = f"--trace {path}"
    if p.is_dir():
        raise DraftflowError(f"{flag}: is a directory; name a file in it, e.g. --trace {p / 'trace.jsonl'}")
    if not p.parent.is_dir():
        raise DraftflowError(f"{flag}: the folder {p.parent} does not exist; create it first or choose another path")
    real = p.resolve()
    for source, what in inputs:
        source = Path(source).resolve()
        if real == source or (source.is_dir() and real.is_relative_to(source)):
            where = what if real == source else f"inside {what} ({source})"
            raise DraftflowError(f"{flag}: is {where}, which this run reads; write the trace somewhere else")
    if p.is_file() and not _is_trace(p):
        raise DraftflowError(f"{flag}: {p} exists and is not a draftflow trace; refusing to overwrite it; "
                             f"remove it or choose another name")
    return p


class JsonlSink:
    """Trace sink writing every event as one JSON line; register with ``registry.pm.register``.

    The file is truncated on open (see ``check_trace_path`` for what may be overwritten).
    """

    def __init__(self, path: Path | str):
        self.path = Path(path)
        try:
            self._file = self.path.open("w", encoding="utf-8")
        except OSError as exc:
            raise DraftflowError(f"--trace {self.path}: cannot open for writing: {exc.strerror}; choose a writable path") from None

    def _write(self, kind: str, event: dict) -> None:
        self._file.write(json.dumps({"event": kind, **event}) + "\n")
        self._file.flush()

    @hookimpl
    def draftflow_cycle_event(self, event):
        self._write("draft_cycle", event)

    @hookimpl
    def draftflow_request_event(self, event):
        self._write("request_done", event)

    def close(self) -> None:
        self._file.close()
