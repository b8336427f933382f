"""A training run whose loss or weights became inf or NaN: found where the loop already gathers its
losses (one all-reduce per report), and failed there before a checkpoint or model keeps them."""

from __future__ import annotations

import math

import torch

from training_core.errors import TrainingDivergedError
from training_core.train.config import TrainingConfig


def trainable_weights_norm(model) -> torch.Tensor:
    """Sum of the trainable weights' norms on this rank: inf or NaN when any weight is. A reduction per
    weight, which allocates no copy of it (ZeRO-3: this rank's shard, ``ds_tensor``)."""
    norms = [torch.linalg.vector_norm(getattr(parameter, "ds_tensor", parameter)).float()
             for parameter in model.parameters() if parameter.requires_grad]
    return torch.stack(norms).sum() if norms else torch.zeros(())


def refuse_diverged_training(first_step: int, step_losses: list[float], weights_norm: float, step: int,
                              config: TrainingConfig) -> None:
    """A loss or weights that are no longer finite: the run fails (a retry with the same seed and data
    diverges the same way), naming the first step whose loss was not finite."""
    diverged = next(((first_step + offset, loss) for offset, loss in enumerate(step_losses)
                     if not math.isfinite(loss)), None)
    if diverged is None and math.isfinite(weights_norm):
        return
    what = (f"the training loss was {diverged[1]} at step {diverged[0]} (first seen when the losses of steps "
            f"{first_step}-{step} were gathered)" if diverged is not None
            else f"the trainable weights hold inf or NaN after step {step} (every loss up to it was finite)")
    raise TrainingDivergedError(
        f"training diverged: {what}; no checkpoint or model is written from it (earlier checkpoints are kept). The "
        f"same settings diverge again: lower learning_rate (now {config.learning_rate:g}), keep gradient_clipping on "
        f"(now {config.gradient_clipping:g}), or look for inf/NaN weights in the base model"
    )
