"""The `draftflow serve` command: its flags checked, the graph opened with the serve defaults, then the server."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from draftflow.core.errors import DraftflowError
from draftflow.core.listen import check_listen
from draftflow.core.server import ServeConfig, serve
from draftflow.core.serving import Engine
from draftflow.core.session import Session
from draftflow.core.spec import MAX_BATCH, read_graph_dict, resolve_graph


def batch_overrides(graph: Path, overrides: list, max_batch: str | None) -> list:
    """The graph overrides `serve` runs with: ``--max-batch`` sets the graph's max_batch (after any ``--set``);
    without it, a graph that leaves max_batch out (file and ``--set``) is served with ``max_batch: auto``."""
    if max_batch is not None:
        value = max_batch.strip()
        if value != "auto" and not (value.isdigit() and 1 <= int(value) <= MAX_BATCH):
            raise DraftflowError(f"--max-batch {max_batch!r}: it must be an integer from 1 to {MAX_BATCH} or 'auto'")
        return [*overrides, (f"--max-batch {value}", f"max_batch={value}")]
    try:
        data, located = read_graph_dict(graph)
        data = resolve_graph(data, list(overrides), located=located)[0]
    except DraftflowError:  # Session.open reports it together with every other problem
        return list(overrides)
    return list(overrides) if "max_batch" in data else [*overrides, ("max_batch auto (serve's default)", "max_batch=auto")]


def run_serve(args) -> int:
    """`draftflow serve GRAPH`: check and open the graph, then listen until SIGINT / SIGTERM."""
    for flag in ("max_waiting", "max_body_bytes", "max_tokens_limit", "default_max_tokens", "max_n", "prefill_budget"):
        if getattr(args, flag) < 1:  # --max-waiting 0 would refuse every request: each one waits before it runs
            raise DraftflowError(f"--{flag.replace('_', '-')} is {getattr(args, flag)}; it must be at least 1")
    if args.default_max_tokens > args.max_tokens_limit:
        raise DraftflowError(f"--default-max-tokens {args.default_max_tokens} is above --max-tokens-limit "
                             f"{args.max_tokens_limit}; lower it or raise the limit")
    for flag, values in (("--api-key", args.api_keys), ("--served-model-name", args.model_names)):
        if any(not v.strip() for v in values):
            raise DraftflowError(f"{flag} is empty; pass a non-empty value")
    overrides = batch_overrides(Path(args.graph), args.overrides, args.max_batch)
    keys = tuple(args.api_keys) or tuple(k for k in [os.environ.get("DRAFTFLOW_API_KEY")] if k)
    if os.environ.get("RANK", "0") == "0":  # tensor-parallel ranks > 0 mirror rank 0 and never listen
        check_listen(args.host, args.port)  # a taken port or a wrong --host before the model loads
    # Session.open runs the full `check` (every problem at once) before anything is allocated or bound; it runs on
    # the engine's worker thread, which then decodes: the thread that warmed the model up runs every cycle.
    engine = Engine.open_in_worker(lambda: Session.open(graph_path=Path(args.graph), overrides=overrides,
                                                        trace=args.trace, threads=getattr(args, "threads", None)),
                                   max_waiting=args.max_waiting, prefill_budget=args.prefill_budget)
    session = engine.session
    print(f"draftflow serve: graph '{session.plan.spec.name}' checked: {len(session.plan.order)} nodes, "
          f"num_draft {session.plan.spec.num_draft}, context {session.executor.kv_tokens} tokens, "
          f"max_batch {session.executor.max_batch}", file=sys.stderr)
    config = ServeConfig(host=args.host, port=args.port, api_keys=keys, max_body_bytes=args.max_body_bytes,
                         max_waiting=args.max_waiting, max_tokens_limit=args.max_tokens_limit,
                         default_max_tokens=args.default_max_tokens, model_names=tuple(args.model_names),
                         spec_stats=args.spec_stats, max_n=args.max_n, prefill_budget=args.prefill_budget)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        serve(session, config, engine=engine)
    except KeyboardInterrupt:
        pass
    finally:
        session.close()
    return 0
