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
