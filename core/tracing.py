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

import attrs
import structlog

from draftflow.core.hookspecs import hookimpl

log = structlog.get_logger("draftflow")

CYCLE_FIELDS = ("request_id", "cycle", "position", "anchor", "draft", "accepted", "emitted",
                "draft_ms", "verify_ms", "commit_ms")
REQUEST_FIELDS = ("request_id", "tokens", "cycles", "drafted", "accepted", "tau", "acceptance_rate",
                  "per_position_acceptance", "tokens_per_s", "ttft_s", "finish_reason")


def configure_logging(verbose: bool = False, json_lines: bool | None = None) -> None:
    """Set up structlog for the CLI: INFO (cycle events) with -v, WARNING otherwise; logs go to stderr."""
    if json_lines is None:
        json_lines = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso"), renderer],
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
    log.info("draft_cycle", **event)
    hook.draftflow_cycle_event(event=event)


def emit_request(hook, event: dict) -> None:
    log.info("request_done", **event)
    hook.draftflow_request_event(event=event)


class JsonlSink:
    """Trace sink writing every event as one JSON line; register with ``registry.pm.register``."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        try:
            self._file = self.path.open("w", encoding="utf-8")
        except OSError as exc:
            from draftflow.core.errors import DraftflowError

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
