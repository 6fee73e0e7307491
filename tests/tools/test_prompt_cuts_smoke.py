"""benchmarks/prompt_cuts.py builds its three prompt kinds from real functions and runs them on the small pair."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

from helpers import ROOT, SMALL_PAIR

sys.path.insert(0, str(ROOT / "benchmarks"))
from prompt_cuts import KINDS, prompt_texts  # noqa: E402


def test_prompts_end_where_their_kind_says():
    texts = prompt_texts(3)
    assert all(len(texts[k]) == 3 for k in KINDS)
    for head, line_cut, char_cut in zip(*(texts[k] for k in KINDS)):
        fn = ast.parse(head.lstrip()).body[0]  # through the docstring: a whole function whose body is its docstring
        assert isinstance(fn, ast.FunctionDef) and ast.get_docstring(fn) and len(fn.body) == 1
        assert head.endswith("\n") and line_cut.endswith("\n") and len(line_cut) > len(head)
        assert line_cut.startswith(head) and char_cut.startswith(head) and len(char_cut) >= len(head) + 10


def test_cli_reports_tau_per_prompt_kind(tmp_path):
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "prompt_cuts.py"), "--functions", "2",
                          "--max-new-tokens", "8", "--num-draft", "7", "--demo", str(SMALL_PAIR), "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(out.read_text())
    assert set(r) == {f"DFlash / {k}" for k in KINDS} and all(v["tau"] >= 1.0 for v in r.values())
    assert "after docstring" in run.stdout


def test_an_unknown_row_is_one_error_line():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "prompt_cuts.py"), "--configs", "DFlash", "nope",
                          "--demo", str(SMALL_PAIR)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith("error: --configs nope: no such row; choose from target only, ")
    assert run.stderr.count("\n") == 1, run.stderr
