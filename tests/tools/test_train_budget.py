"""`--time-budget-min` is wall time: held-out evaluations and checkpoints count towards it."""

from __future__ import annotations

import time

import torch

from draftflow.tools.train.loop import TrainOptions, train


class SlowEvalRecipe:
    """A one-weight model whose held-out evaluation takes 0.25 s (as a real acceptance estimate can)."""

    def __init__(self) -> None:
        self.module = torch.nn.Linear(4, 1)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.module(tokens.float()).pow(2).mean()

    def evaluate(self, windows) -> dict[str, float]:
        time.sleep(0.25)
        return {"loss": 0.0}


class Sampler:
    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(0)

    def batch(self, n: int) -> torch.Tensor:
        return torch.randint(0, 5, (n, 4), generator=self.generator)

    def held_out(self, count: int) -> list[torch.Tensor]:
        return []


def test_evaluations_count_towards_the_time_budget(tmp_path):
    t0 = time.perf_counter()
    result = train(SlowEvalRecipe(), Sampler(), TrainOptions(steps=10_000, eval_every=1, save_every=0, time_budget_s=1.0),
                   stream=open(tmp_path / "log", "w"))
    wall = time.perf_counter() - t0
    assert result.steps <= 6 and wall < 3.0, (result.steps, wall)  # ~4 steps of 0.25 s, not 10,000 evaluations
    assert result.elapsed_s >= 1.0


def test_a_stop_signal_is_recorded_once_then_handed_on():
    """StopSignals records the first SIGTERM and hands a second to the handler that was there before."""
    import os
    import signal

    from draftflow.tools.train.loop import StopSignals

    seen = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.name == "SIGTERM" and seen == []
            os.kill(os.getpid(), signal.SIGTERM)
            assert seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is not stop._record
    finally:
        signal.signal(signal.SIGTERM, before)


def test_sigterm_ends_a_cli_run_with_the_drafter_written_and_resume_continues(tmp_path):
    """`draftflow train` stopped by SIGTERM mid-run writes the drafter, checkpoint and summary, exits 0, and says so;
    --resume continues from the step it stopped at."""
    import json
    import signal
    import subprocess
    import sys

    from helpers import ROOT, SMALL_PAIR

    summary = tmp_path / "s.json"
    args = [sys.executable, "-m", "draftflow", "train", "dflash", "--target", str(SMALL_PAIR / "target"), "--out",
            str(tmp_path / "d"), "--data", str(ROOT / "core"), "--seq-len", "48", "--batch-size", "2", "--block-size", "4",
            "--layers", "1", "--anchors", "2", "--eval-every", "0", "--eval-windows", "2", "--save-every", "0",
            "--max-data-mb", "0.1", "--device", "cpu", "--summary", str(summary)]
    proc = subprocess.Popen(args + ["--steps", "1000000"], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # the intro line comes just before the first step
            if line.startswith("train dflash:"):
                break
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    s = json.loads(summary.read_text())
    assert s["stopped_by"] == "SIGTERM" and 1 <= s["steps"] < 1000000, s
    assert f"note: SIGTERM ended the run at step {s['steps']} of 1000000" in err and "Traceback" not in err
    assert (tmp_path / "d" / "model.safetensors").exists() and (tmp_path / "d" / "checkpoint.pt").exists()
    stopped = s["steps"]
    r = subprocess.run(args + ["--steps", str(stopped + 2), "--resume"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    s = json.loads(summary.read_text())
    assert s["resumed_from"] == stopped and s["steps"] == stopped + 2 and s["stopped_by"] is None, s
