"""The `--dflash` shortcut: `generate --target T --dflash D` builds the tapped graph and stays lossless."""

from __future__ import annotations

import json

from dflash_testlib import BLOCK, agreeing_pair
from helpers import run_cli


def test_generate_shortcut_matches_target_only(tmp_path):
    """--dflash sets the target's tap layers from the artifact; output equals target-only; drafts are accepted."""
    target, drafter = agreeing_pair(tmp_path)
    common = ["generate", "--target", target, "--prompt-ids", "3,4,5,6", "--max-new-tokens", "24", "--json", "--spec", str(BLOCK - 1),
              "--ignore-eos"]
    spec = run_cli([*common, "--dflash", drafter], cwd=tmp_path)
    ref = run_cli(common, cwd=tmp_path)
    assert spec.returncode == 0 and ref.returncode == 0, spec.stderr + ref.stderr
    a, b = json.loads(spec.stdout), json.loads(ref.stdout)
    assert a["token_ids"] == b["token_ids"]
    assert a["stats"]["drafted"] > 0 and a["stats"]["accepted"] > 0


def test_a_triton_param_that_is_not_a_bool_is_one_line_and_nothing_runs(tmp_path):
    """`triton: maybe` on a dflash node: `draftflow check` and `generate` exit 1 with one error line naming the node,
    the param and the fix, no traceback, and write no trace file."""
    from helpers import ROOT

    graph = ROOT / "graphs" / "demo-dflash.yaml"
    bad = "nodes.drafter.params.triton=maybe"
    for args in (["check", graph, "--set", bad],
                 ["generate", "--graph", graph, "--set", bad, "--prompt", "def f(x):", "--trace", tmp_path / "t.jsonl"]):
        r = run_cli(args, cwd=tmp_path)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        lines = [line for line in r.stderr.splitlines() if "triton" in line]
        assert len(lines) == 1 and "node 'drafter' (dflash)" in lines[0] and "expected true or false" in lines[0] \
            and "fix:" in lines[0], r.stderr
    assert not (tmp_path / "t.jsonl").exists()
