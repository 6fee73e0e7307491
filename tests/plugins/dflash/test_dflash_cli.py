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
