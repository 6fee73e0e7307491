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
