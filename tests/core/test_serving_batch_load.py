"""The load-test tool against a live in-process `draftflow serve` of the demo graph, at concurrency 1, 8 and 32."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from helpers import ROOT, SMALL_PAIR

from draftflow.tools import load_test

pytest.importorskip("openai")


def test_load_test_reports_each_concurrency():
    """Every level answers without errors through the openai client; percentiles are ordered; 32 clients batch."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = load_test.main(["--graph", str(SMALL_PAIR / "demo.yaml"), "--concurrency", "1,8,32", "--max-tokens", "6",
                               "--requests", "32", "--warmup", "8", "--json"])
    report = json.loads(out.getvalue().splitlines()[-1])
    assert code == 0 and report["client"] == "openai"
    assert [level["concurrency"] for level in report["levels"]] == [1, 8, 32]
    for level in report["levels"]:
        assert (level["requests"], level["errors"]) == (32, 0) and level["output_tokens_per_s"] > 0
        for key in ("ttft_s", "latency_s"):
            assert level[key]["p50"] <= level[key]["p90"] <= level[key]["p99"]
        assert level["ttft_s"]["p50"] <= level["latency_s"]["p50"]
    assert report["levels"][0]["mean_batch"] == 1.0 and report["levels"][2]["mean_batch"] > 2
    assert all(level["mean_acceptance_length"] > 1 for level in report["levels"])  # the demo's DFlash drafts are accepted
