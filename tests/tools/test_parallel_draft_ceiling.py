"""benchmarks/parallel_draft_ceiling.py: the best draft distribution it fits is optimal, its simulated verification
accepts a near-greedy target's ideal drafts every time, and the script runs end to end on the small pair."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import torch
from helpers import ROOT, SMALL_PAIR

from draftflow.plugins.target.hf_loader import load_hf

SCRIPT = ROOT / "benchmarks" / "parallel_draft_ceiling.py"
spec = importlib.util.spec_from_file_location("parallel_draft_ceiling", SCRIPT)
ceiling = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ceiling)


def _acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    return float(torch.minimum(p, q).sum(1).mean())


def test_best_single_beats_every_other_draft_distribution():
    torch.manual_seed(0)
    for n, v in ((1, 4), (5, 6), (9, 3)):
        p = torch.distributions.Dirichlet(torch.full((v,), 0.5)).sample((n,))
        q = ceiling.best_single(p)
        assert q.shape == (v,) and float(q.min()) >= 0 and abs(float(q.sum()) - 1) < 1e-5
        best = _acceptance(p, q)
        others = torch.distributions.Dirichlet(torch.ones(v)).sample((4000,))
        assert best >= _acceptance(p, p.mean(0)) - 1e-6  # the marginal
        assert all(best >= _acceptance(p, o) - 1e-6 for o in others)
        assert n > 1 or abs(best - 1) < 1e-5  # one row: q = p, always accepted
    # three rows putting all their mass on tokens 0, 0, 2: q on token 0 accepts 2 rows of 3
    p = torch.tensor([[1.0, 0, 0], [1.0, 0, 0], [0, 0, 1.0]])
    assert abs(_acceptance(p, ceiling.best_single(p)) - 2 / 3) < 1e-6


def test_a_near_greedy_target_accepts_its_marginal_drafts_every_time():
    """At T = 0.01 the small target is (almost) deterministic: the marginal is its greedy chain, accepted throughout
    (tau = K + 1); at T = 1 later drafts are lost."""
    target = load_hf(SMALL_PAIR / "target", "cpu", torch.float32).model.eval()
    ids = list(range(5, 25))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        cold = ceiling.marginals(target, ids, 4, 16, 0.01, gen)
        sure = ceiling.accepted_prefix(target, ids, 4, lambda i, _p: cold[i], 16, 0.01, gen)
        warm = ceiling.marginals(target, ids, 4, 64, 1.0, gen)
        unsure = ceiling.accepted_prefix(target, ids, 4, lambda i, _p: warm[i], 64, 1.0, gen)
    assert float(sure.min()) > 0.99 and float(cold.max(1).values.min()) > 0.99
    assert float(unsure[0]) > 0.99 and float(unsure[-1]) < 0.9  # position 1: q = p exactly; later ones are not


def test_script_prints_both_ceilings(tmp_path):
    out = tmp_path / "ceiling.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--demo", str(SMALL_PAIR), "--limit", "1", "--anchors", "0,4",
                          "--rollouts", "16", "--num-draft", "3", "--json", str(out)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["prompts"] == 1 and set(result["tau"]) == {"marginal", "best"}
    for name in ("marginal", "best"):
        taus = [result["tau"][name][str(k)] for k in (1, 2, 3)]
        assert taus[0] == 2.0 and taus == sorted(taus) and taus[-1] <= 4.0
    assert "| 3 |" in run.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--temperature", "0"], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("error: --temperature must be above 0")
