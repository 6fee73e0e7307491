"""benchmarks/cpu_thread_teams.py runs its three cases (each in a fresh process) and prints a row for each."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import ROOT, SMALL_PAIR


def test_each_case_prints_its_request_times(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_thread_teams.py"), "--graph",
                        str(SMALL_PAIR / "demo-dflash2.yaml"), "--requests", "2"], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = re.findall(r"^(main|beside|worker) +(\d+) (\d+) ", r.stdout, flags=re.M)
    assert [row[0] for row in rows] == ["main", "beside", "worker"], r.stdout
    assert all(int(a) > 0 and int(b) > 0 for _, a, b in rows), r.stdout
