"""The learning-rate schedule, step by step, against values computed by hand.

DeepSpeed steps the scheduler once per optimizer step: the rate of optimizer step k (from 0) is the
scheduler's after k calls of step()."""

from __future__ import annotations

import pytest
import torch

from training_core.train.config import TrainingConfig
from training_core.train.schedule import build_lr_scheduler

PEAK = 0.2
# Warmup 4 of 12 steps: steps 0-3 warm up, the 8 steps 4-11 follow the schedule (progress (step - 4) / 8).
WARMUP, MAX_STEPS = 4, 12


def _rates(schedule: str, warmup: int = WARMUP) -> list[float]:
    """The learning rate of every optimizer step 0..MAX_STEPS - 1."""
    config = TrainingConfig(learning_rate=PEAK, lr_schedule=schedule, warmup_steps=warmup, max_steps=MAX_STEPS)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.learning_rate)
    scheduler = build_lr_scheduler(optimizer, config)
    rates = []
    for _ in range(MAX_STEPS):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


# Warmup ramps linearly to the peak, reached at its last step: (step + 1) / warmup.
WARMUP_RATES = [0.05, 0.10, 0.15, 0.20]


@pytest.mark.parametrize(("schedule", "after_warmup"), [
    ("constant", [0.2] * 8),
    # 1 - progress: 1, 7/8, 6/8, ... 1/8 of the peak.
    ("linear", [0.2, 0.175, 0.15, 0.125, 0.1, 0.075, 0.05, 0.025]),
    # (1 + cos(pi * progress)) / 2 of the peak: cos(pi/8) = 0.92388, cos(pi/4) = 0.70711, cos(3pi/8) = 0.38268.
    ("cosine", [0.2, 0.192388, 0.170711, 0.138268, 0.1, 0.061732, 0.029289, 0.007612]),
])
def test_rates_warm_up_then_follow_the_schedule(schedule, after_warmup):
    assert _rates(schedule) == pytest.approx(WARMUP_RATES + after_warmup, abs=1e-6)


def test_without_warmup_the_first_step_has_the_peak_rate():
    rates = _rates("linear", warmup=0)
    assert rates[0] == pytest.approx(PEAK)
    assert rates[6] == pytest.approx(PEAK / 2)  # progress 6 / 12
    assert rates[-1] == pytest.approx(PEAK / 12)
