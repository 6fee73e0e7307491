"""Does where a prompt ends change a drafter's acceptance? Tau at three kinds of prompt ends on real Python.

    python benchmarks/prompt_cuts.py [--functions 40] [--configs DFlash DFlash2] [--device cpu] [--json F]

From the running interpreter's standard library (files in a seeded order), it takes top-level
functions that have a docstring and at least 6 lines after it, and builds three prompts from
each, all starting at the `def` (or its decorators):
- "after docstring": through the docstring's last line, as a HumanEval prompt ends;
- "line end in body": through a random later line of the body;
- "char in body": through a random character of the body (often mid-line, mid-token).
Every prompt decodes 128 new tokens at T = 0 through each row of `tools/bench_humaneval.py`
(fixed K = --num-draft) and the table gives tau and the first per-position acceptances. Most of
these files were in the demo target's training text: compare the rows, not the values with
HumanEval's. docs/BENCHMARKS.md (2026-12-04) has a run.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
from pathlib import Path

from draftflow.core.errors import DraftflowError
from draftflow.core.session import Session
from draftflow.core.tracing import configure_logging
from draftflow.tools.bench_humaneval import DEMO, demo_configs, run_config, select_configs

KINDS = ("after docstring", "line end in body", "char in body")


def prompt_texts(count: int, seed: int = 0, root: Path | None = None) -> dict[str, list[str]]:
    """`count` functions' three prompts each: {kind: [text]}."""
    rng = random.Random(seed)
    files = sorted(Path(root or sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng.shuffle(files)
    out: dict[str, list[str]] = {kind: [] for kind in KINDS}
    for f in files:
        try:
            src = f.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        functions = [n for n in tree.body if isinstance(n, ast.FunctionDef) and ast.get_docstring(n)
                     and n.end_lineno - n.body[0].end_lineno >= 6]
        if not functions:
            continue
        fn = rng.choice(functions)
        lines = src.splitlines(keepends=True)
        start, doc_end, end = fn.lineno - 1 - len(fn.decorator_list), fn.body[0].end_lineno, fn.end_lineno
        head = "".join(lines[start:doc_end])
        body = "".join(lines[start:end])
        out["after docstring"].append(head)
        out["line end in body"].append("".join(lines[start:rng.randint(doc_end + 1, end - 3)]))
        out["char in body"].append(body[:rng.randint(len(head) + 10, len(body) - 20)])
        if len(out["after docstring"]) == count:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--functions", type=int, default=40, help="functions, one from each file taken")
    p.add_argument("--configs", nargs="+", default=["DFlash"], help="rows of tools/bench_humaneval.py")
    p.add_argument("--num-draft", type=int, default=15)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--demo", default=str(DEMO), help="folder with target/ and the drafters (bench_humaneval's --demo)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    configure_logging(verbose=False)
    configs = demo_configs(a.device, a.num_draft, Path(a.demo))
    try:
        select_configs(configs, a.configs)
    except DraftflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    texts = prompt_texts(a.functions)
    results = {}
    print(f"{len(texts['after docstring'])} functions, {a.max_new_tokens} new tokens, T = 0, K = {a.num_draft}")
    print(f"{'row':<12}{'prompt ends':<20}{'tau':>6}   per-position 1..4")
    for name in a.configs:
        session = Session.open(graph_dict=configs[name])
        context = session.executor.kv_tokens - a.max_new_tokens
        for kind in KINDS:
            prompts = [session.encode(t)[-context:] for t in texts[kind]]
            r = run_config(session, prompts, 0.0, a.max_new_tokens)
            results[f"{name} / {kind}"] = r
            pos = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"][:4])
            print(f"{name:<12}{kind:<20}{r['tau']:>6.2f}   {pos}")
        session.close()
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
