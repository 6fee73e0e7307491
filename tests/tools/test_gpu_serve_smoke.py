"""benchmarks/gpu_serve.py runs end to end on the CPU at toy shapes: both graphs served, every request answered."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import ROOT


def test_tiny_cpu_run_answers_every_request(tmp_path):
    """--tiny: the spawned server answers every load-test request of both graphs (the demo tokenizer's prompt ids
    once fell outside the toy vocabulary, and every request was a 400)."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_serve.py"), "--tiny", "--concurrency", "1,2",
                        "--max-tokens", "4", "--warmup", "2"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "## target-only" in r.stdout and "## dflash-adaptive" in r.stdout, r.stdout
    rows = re.findall(r"^ +(\d+) +(\d+) +(\d+) +([\d.]+) +([\d.]+) ", r.stdout, flags=re.M)  # conc reqs err req/s tok/s
    assert [int(c) for c, *_ in rows] == [1, 2, 1, 2], r.stdout
    assert all(int(reqs) > 0 and int(err) == 0 and float(tok_s) > 0 for _, reqs, err, _, tok_s in rows), r.stdout
