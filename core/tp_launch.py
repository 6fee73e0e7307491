"""`--tp N`: a command run as N local processes, one per rank, like `torchrun --nproc-per-node N` on one host.

Each worker is the same `python -m draftflow ...` command with torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT: a free port), so both launchers run one
code path: the session joins the process group from that environment (NCCL on CUDA, gloo on the
CPU). Rank 0 prints and serves; the others' output goes nowhere, their errors to a log that is
shown when a follower alone fails. When one worker fails, the others are stopped.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from draftflow.core.errors import DraftflowError

POLL_S = 0.05
FOLLOWER_GRACE_S = 60.0  # after rank 0 ended well, how long the followers get to see its close and exit
STOP_GRACE_S = 30.0  # after an interrupt, how long the workers get to end cleanly (a busy host is slow to)
LOG_TAIL = 4000


def tp_overrides(args) -> list:
    """`--tp N` as the graph override it stands for (errors about the value then name `--tp N`); under torchrun
    without `--tp`, the process count (WORLD_SIZE) for generate and serve."""
    tp = getattr(args, "tp", None)
    if tp is not None:
        return [(f"--tp {tp}", f"tensor_parallel={tp}")]
    world = os.environ.get("WORLD_SIZE", "1")
    if "RANK" in os.environ and world.isdigit() and int(world) > 1 and args.command in ("generate", "serve"):
        return [(f"torchrun's WORLD_SIZE {world}", f"tensor_parallel={world}")]
    return []


def launch_size(args) -> int:
    """How many ranks this `generate` / `serve` starts: `--tp N`, else the graph's `tensor_parallel` (a `--set`, then
    the graph file); 1 inside a rank already (torchrun or our own workers set RANK) and for other commands."""
    if args.command not in ("generate", "serve") or "RANK" in os.environ:
        return 1
    if getattr(args, "tp", None) is not None:
        return args.tp
    sets = [o.partition("=")[2].strip() for o in args.overrides if o.partition("=")[0].strip() == "tensor_parallel"]
    if sets:
        return int(sets[-1]) if sets[-1].isdigit() else 1  # a bad value: the spec reports it, in one process
    if getattr(args, "graph", None):
        from draftflow.core.spec import read_graph_dict

        try:
            value = read_graph_dict(Path(args.graph))[0].get("tensor_parallel", 1)
        except DraftflowError:  # the session reports it
            return 1
        return value if isinstance(value, int) and not isinstance(value, bool) else 1
    return 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str], size: int) -> int:
    """Run `draftflow ARGV` as ``size`` ranks; return rank 0's exit code (a follower's when only it failed)."""
    if size > 64:
        raise DraftflowError(f"--tp {size}: at most 64 ranks; pass the number of GPUs to shard the target over")
    port = free_port()
    procs, logs = [], []
    for rank in range(size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        log = None if rank == 0 else tempfile.TemporaryFile()
        logs.append(log)
        quiet = {} if rank == 0 else {"stdout": subprocess.DEVNULL, "stderr": log, "stdin": subprocess.DEVNULL}
        procs.append(subprocess.Popen([sys.executable, "-m", "draftflow", *argv], env=env, **quiet))
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        codes, failed = _wait(procs)
    except KeyboardInterrupt:  # Ctrl-C reached the workers too; SIGTERM only this process: pass it on to rank 0
        codes, failed = _stop(procs), None
    finally:
        signal.signal(signal.SIGTERM, previous)
    if failed is None or failed == 0:
        return codes[0] if codes[0] >= 0 else 1
    logs[failed].seek(0)
    tail = logs[failed].read().decode(errors="replace")[-LOG_TAIL:]
    sys.stderr.write(f"error: tensor-parallel rank {failed} exited with code {codes[failed]}:\n{tail}")
    return codes[failed] if codes[failed] > 0 else 1


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _stop(procs: list[subprocess.Popen]) -> list[int]:
    """Ask rank 0 to end (serve closes its session, which releases the followers); then stop what is left."""
    if procs[0].poll() is None:
        procs[0].send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_S)
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [p.wait() for p in procs]


def _wait(procs: list[subprocess.Popen]) -> tuple[list[int], int | None]:
    """Wait for every worker: (exit codes, the rank that failed first or None). When one fails the rest are
    stopped; when rank 0 is done the others get a grace period to exit."""
    done_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return codes, None
        failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            return [p.wait() for p in procs], failed
        if codes[0] == 0:
            done_at = done_at or time.monotonic()
            if time.monotonic() - done_at > FOLLOWER_GRACE_S:
                for p in procs[1:]:
                    p.kill()
        time.sleep(POLL_S)
