"""A training run whose loss, gradients or weights became inf or NaN: found where the loop already
gathers its losses (one all-reduce per report), and failed there before a checkpoint or model keeps them.

Gradients that overflow leave loss and weights finite: ZeRO and DeepSpeed's bf16 optimizer then skip
the update (``engine.was_step_applied()`` is False) and the run would train on without learning. fp16,
whose loss scaling skips early steps by design, is refused by the config: every skip is an overflow."""

from __future__ import annotations

import math
from collections.abc import Sequence

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
                              config: TrainingConfig, skipped_steps: Sequence[int] = (),
                              earlier_losses: Sequence[tuple[int, float]] = ()) -> None:
    """A loss or weights that are no longer finite, or a step whose update DeepSpeed skipped because
    its gradients were (``skipped_steps``): the run fails (a retry with the same seed and data diverges
    the same way), naming the first step whose loss was not finite, else the first skipped step (a
    non-finite loss makes non-finite gradients: the loss is the cause to name). The error carries
    ``earlier_losses`` (the curve so far) and this report's losses up to the step it names (a skipped
    step's own loss was computed before its update was skipped: finite, and kept)."""
    diverged = next(((first_step + offset, loss) for offset, loss in enumerate(step_losses)
                     if not math.isfinite(loss)), None)
    if diverged is None and not skipped_steps and math.isfinite(weights_norm):
        return
    if diverged is not None:
        what = (f"the training loss was {diverged[1]} at step {diverged[0]} (first seen when the losses of steps "
                f"{first_step}-{step} were gathered)")
        last_kept = diverged[0] - 1
    elif skipped_steps:
        what = (f"the gradients of step {skipped_steps[0]} were inf or NaN, so DeepSpeed skipped its update "
                f"({len(skipped_steps)} of steps {first_step}-{step} skipped, every loss finite)")
        last_kept = skipped_steps[0]
    else:
        what = f"the trainable weights hold inf or NaN after step {step} (every loss up to it was finite)"
        last_kept = step
    curve = [*earlier_losses, *((first_step + offset, loss) for offset, loss in enumerate(step_losses)
                                if first_step + offset <= last_kept)]
    clipping = (f"keep gradient_clipping on (now {config.gradient_clipping:g})" if config.gradient_clipping > 0
                else "turn gradient_clipping on (now 0: off; the default is 1)")
    alpha = (f", lower lora.alpha (lora_adapter's lora_alpha; now {config.lora.alpha})" if config.method != "full"
             else "")
    raise TrainingDivergedError(
        f"training diverged: {what}; no checkpoint or model is written from it (earlier checkpoints are kept). The "
        f"same settings diverge again: lower learning_rate (now {config.learning_rate:g}){alpha}, {clipping}, or look "
        f"for inf/NaN weights in the base model",
        loss_history=curve,
    )
