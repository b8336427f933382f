"""The divergence check the training loop runs where it gathers its losses: a non-finite loss, or
trainable weights gone inf/NaN while every loss stayed finite (a last step's update), fail the run."""

from __future__ import annotations

import math

import pytest

from training_core.errors import TrainingDivergedError
from training_core.train.config import TrainingConfig
from training_core.train.divergence import refuse_diverged_training


def test_finite_losses_and_weights_pass():
    refuse_diverged_training(5, [1.0, 0.9], 12.5, 6, TrainingConfig())


def test_the_first_step_whose_loss_is_not_finite_is_named():
    with pytest.raises(TrainingDivergedError, match=r"the training loss was nan at step 6 \(first seen when the "
                                                    r"losses of steps 5-7 were gathered\)"):
        refuse_diverged_training(5, [1.0, math.nan, math.inf], 12.5, 7, TrainingConfig())


@pytest.mark.parametrize("weights_norm", [math.nan, math.inf])
def test_weights_gone_inf_or_nan_with_every_loss_finite_are_refused(weights_norm):
    with pytest.raises(TrainingDivergedError, match="the trainable weights hold inf or NaN after step 6 "
                                                    r"\(every loss up to it was finite\)"):
        refuse_diverged_training(5, [1.0, 0.9], weights_norm, 6, TrainingConfig())


def test_a_step_whose_update_deepspeed_skipped_is_refused_naming_it_and_what_to_lower():
    config = TrainingConfig(learning_rate=1.0, gradient_clipping=0.0, lora={"alpha": 10**9})
    with pytest.raises(TrainingDivergedError) as refused:
        refuse_diverged_training(5, [1.0, 0.9, 0.8], 12.5, 7, config, skipped_steps=[6, 7])
    assert str(refused.value) == (
        "training diverged: the gradients of step 6 were inf or NaN, so DeepSpeed skipped its update (2 of steps 5-7 "
        "skipped, every loss finite); no checkpoint or model is written from it (earlier checkpoints are kept). The "
        "same settings diverge again: lower learning_rate (now 1), lower lora.alpha (lora_adapter's lora_alpha; now "
        "1000000000), turn gradient_clipping on (now 0: off; the default is 1), or look for inf/NaN weights in the "
        "base model")


def test_a_non_finite_loss_is_named_before_the_update_it_made_deepspeed_skip():
    with pytest.raises(TrainingDivergedError, match=r"the training loss was nan at step 6 "):
        refuse_diverged_training(5, [1.0, math.nan], 12.5, 6, TrainingConfig(), skipped_steps=[6])


EARLIER = [(1, 2.0), (2, 1.9)]


@pytest.mark.parametrize("losses, weights_norm, skipped, curve", [
    ([1.8, math.nan, 1.7], 12.5, [], [(3, 1.8)]),  # up to the step before the non-finite loss
    ([1.8, 1.7, 1.6], 12.5, [4, 5], [(3, 1.8), (4, 1.7)]),  # a skipped step's own loss was finite
    ([1.8, 1.7, 1.6], math.inf, [], [(3, 1.8), (4, 1.7), (5, 1.6)]),  # every loss finite
], ids=["nan-loss", "skipped-update", "weights"])
def test_the_error_carries_the_finite_curve_up_to_the_step_it_names(losses, weights_norm, skipped, curve):
    with pytest.raises(TrainingDivergedError) as refused:
        refuse_diverged_training(3, losses, weights_norm, 5, TrainingConfig(), skipped_steps=skipped,
                                 earlier_losses=EARLIER)
    assert refused.value.loss_history == EARLIER + curve
