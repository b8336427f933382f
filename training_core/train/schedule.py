"""Learning-rate schedules as torch LambdaLR, so DeepSpeed checkpoints their state with the engine."""

from __future__ import annotations

import math

import torch

from training_core.train.config import TrainingConfig


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: TrainingConfig) -> torch.optim.lr_scheduler.LambdaLR:
    warmup, total = config.warmup_steps, config.max_steps

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if config.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if config.lr_schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
