"""Bad trace files for `trace summarize`, and bad image paths for `--plot` / `check --draw`."""

from pathlib import Path

from harness import Case

CYCLE = ('{"event": "draft_cycle", "request_id": "r1", "cycle": 0, "position": 3, "anchor": 5, "draft": [7, 8, 9], '
         '"accepted": 2, "emitted": [7, 8, 4], "draft_ms": 1.5, "verify_ms": 9.0, "commit_ms": 0.02}\n')
DONE = ('{"event": "request_done", "request_id": "r1", "tokens": 3, "cycles": 1, "drafted": 3, "accepted": 2, '
        '"tau": 3.0, "acceptance_rate": 0.667, "per_position_acceptance": [1.0, 1.0, 0.0], "tokens_per_s": 50.0, '
        '"ttft_s": 0.02, "finish_reason": "length"}\n')
TRACE = CYCLE + CYCLE.replace('"cycle": 0', '"cycle": 1') + DONE
GRAPH = "{demo}/demo.yaml"
# A folder on PYTHONPATH whose `matplotlib` fails to import, as on an install without the plot extra.
NO_MPL = {"files": {"nompl/matplotlib/__init__.py": "raise ImportError(\"No module named 'matplotlib'\")\n"},
          "env": {"PYTHONPATH": "nompl"}}
INSTALL = r"needs matplotlib, which is not installed .*pip install 'draftflow\[plot\]'"


def cycle(**fields) -> str:
    """The draft_cycle line with some fields replaced (value None: the field removed)."""
    import json

    event = json.loads(CYCLE)
    for k, v in fields.items():
        if v is None:
            event.pop(k)
        else:
            event[k] = v
    return json.dumps(event) + "\n"


def _absent(*names):
    def check(r, tmp: Path):
        for n in names:
            assert not (tmp / n).exists(), f"{n} was written"
    return check


def _written(name):
    def check(r, tmp: Path):
        assert (tmp / name).stat().st_size > 0, f"{name} not written"
        assert not [p for p in tmp.iterdir() if ".tmp." in p.name], "a temporary image was left behind"
    return check


def _huge_line(tmp: Path) -> None:
    (tmp / "t.jsonl").write_text('{"event": "draft_cycle", "pad": "' + "x" * (3 << 20) + '"}\n')


def _summ(*extra):
    return ["trace", "summarize", "t.jsonl", *extra]


CASES = [
    # what the issue found: random bytes, a missing field, a wrong type, a directory
    Case("trace-random-bytes", _summ(), r"t\.jsonl:1: not UTF-8 text \(byte 0x89\)",
         files={"t.jsonl": b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4}),
    Case("trace-missing-field", _summ(), r"t\.jsonl:2: draft_cycle event has no 'draft' field",
         files={"t.jsonl": CYCLE + cycle(draft=None)}),
    Case("trace-wrong-type-draft", _summ(), r"t\.jsonl:1: draft_cycle field 'draft' is 5; expected a list of token ids",
         files={"t.jsonl": cycle(draft=5)}),
    Case("trace-wrong-type-accepted", _summ(), r"t\.jsonl:1: draft_cycle field 'accepted' is \"2\"; expected an integer",
         files={"t.jsonl": cycle(accepted="2")}),
    Case("trace-accepted-bool", _summ(), r"field 'accepted' is true; expected an integer",
         files={"t.jsonl": cycle(accepted=True)}),
    Case("trace-accepted-past-draft", _summ(), r"field 'accepted' is 5 but the cycle drafted 3 tokens",
         files={"t.jsonl": cycle(accepted=5)}),
    Case("trace-request-id-list", _summ(), r"field 'request_id' is \[1\]; expected a string or integer",
         files={"t.jsonl": cycle(request_id=[1])}),
    Case("trace-draft-ms-nan", _summ(), r"field 'draft_ms' is NaN; expected a finite number",
         files={"t.jsonl": CYCLE.replace('"draft_ms": 1.5', '"draft_ms": NaN')}),
    Case("trace-request-done-bad-rate", _summ(), r"t\.jsonl:2: request_done field 'tokens_per_s' is \"fast\"",
         files={"t.jsonl": CYCLE + DONE.replace('"tokens_per_s": 50.0', '"tokens_per_s": "fast"')}),
    Case("trace-request-done-missing-ttft", _summ(), r"request_done event has no 'ttft_s' field",
         files={"t.jsonl": CYCLE + DONE.replace(', "ttft_s": 0.02', '')}),
    Case("trace-directory", ["trace", "summarize", "{tmp}/d"], r"d: is a folder, not a trace file",
         setup=lambda tmp: (tmp / "d").mkdir()),
    Case("trace-empty-file", _summ(), r"t\.jsonl: the file is empty", files={"t.jsonl": ""}),
    Case("trace-blank-lines", _summ(), r"t\.jsonl: no draft_cycle events", files={"t.jsonl": "\n \n\n"}),
    Case("trace-huge-line", _summ(), r"t\.jsonl:1: a line longer than 1 MiB", setup=_huge_line, timeout=30),
    Case("trace-huge-number", _summ(), r"t\.jsonl:1: not a trace line \(a number too long to read\)",
         files={"t.jsonl": '{"event": "draft_cycle", "accepted": ' + "9" * 5000 + "}\n"}),
    Case("trace-deep-nesting", _summ(), r"t\.jsonl:1: not a trace line \(nested too deeply\)",
         files={"t.jsonl": "[" * 200_000 + "\n"}),
    Case("trace-json-list-line", _summ(), r"t\.jsonl:2: a JSON list where a trace event \(a JSON object\) was expected",
         files={"t.jsonl": CYCLE + "[1, 2]\n"}),
    Case("trace-not-json", _summ(), r"t\.jsonl:1:1: not a JSON line \(Expecting value\)",
         files={"t.jsonl": "hello world\n"}),
    Case("trace-yaml-graph-given", ["trace", "summarize", GRAPH], r"demo\.yaml:\d+:\d+: not a JSON line"),
    # odd but valid: a BOM, unknown events and blank lines are fine; the numbers are the trace's
    Case("trace-bom-and-unknown-events", _summ(), r"requests 1, cycles 2, tokens 6", exit=0,
         files={"t.jsonl": "\ufeff" + CYCLE + '{"event": "other"}\n\n' + CYCLE.replace('"cycle": 0', '"cycle": 1')}),
    # --plot: the image path is checked before anything is read or written
    Case("trace-plot-missing-folder", _summ("--plot", "{tmp}/nodir/p.png"),
         r"--plot .*nodir/p\.png: the folder .*nodir does not exist", files={"t.jsonl": TRACE},
         check=_absent("nodir")),
    Case("trace-plot-unknown-extension", _summ("--plot", "p.xyz"),
         r"--plot p\.xyz: unknown image extension '\.xyz'; use one of .*\.pdf.*\.png.*\.svg", files={"t.jsonl": TRACE},
         check=_absent("p.xyz")),
    Case("trace-plot-no-extension", _summ("--plot", "p"), r"--plot p: no image extension; name the file e\.g\. p\.png",
         files={"t.jsonl": TRACE}, check=_absent("p", "p.png")),
    Case("trace-plot-over-the-trace", ["trace", "summarize", "t.png", "--plot", "t.png"],
         r"--plot t\.png: is the input file t\.png", files={"t.png": TRACE}),
    Case("trace-plot-into-a-folder", _summ("--plot", "out.png"), r"--plot out\.png: is a folder",
         files={"t.jsonl": TRACE}, setup=lambda tmp: (tmp / "out.png").mkdir()),
    Case("trace-plot-no-matplotlib", _summ("--plot", "p.png"), r"--plot " + INSTALL,
         files={"t.jsonl": TRACE, **NO_MPL["files"]}, env=NO_MPL["env"], check=_absent("p.png")),
    Case("trace-plot-written", _summ("--plot", "p.svg", "--json"), r'"tau": 3\.0', exit=0,
         files={"t.jsonl": TRACE}, outputs=["p.svg"], check=_written("p.svg")),
    # check --draw: the same checks, before the graph is planned
    Case("trace-check-draw-missing-folder", ["check", GRAPH, "--draw", "{tmp}/nodir/g.png"],
         r"--draw .*nodir/g\.png: the folder .*nodir does not exist", check=_absent("nodir")),
    Case("trace-check-draw-unknown-extension", ["check", GRAPH, "--draw", "g.dot"],
         r"--draw g\.dot: unknown image extension '\.dot'; use one of .*\.png", check=_absent("g.dot")),
    Case("trace-check-draw-no-extension", ["check", GRAPH, "--draw", "g"], r"--draw g: no image extension",
         check=_absent("g", "g.png")),
    Case("trace-check-draw-no-matplotlib", ["check", GRAPH, "--draw", "g.png"], r"--draw " + INSTALL,
         files=NO_MPL["files"], env=NO_MPL["env"], check=_absent("g.png")),
    Case("trace-check-draw-written", ["check", GRAPH, "--draw", "g.PNG"], r"graph drawn to g\.PNG", exit=0,
         outputs=["g.PNG"], check=_written("g.PNG")),
]
