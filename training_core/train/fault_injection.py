"""The chaos hook: ``TESSERA_FAULT_STEP=N`` kills one training worker once at step N.

Read in the driver, before a run is reused or any worker starts (this module imports nothing
heavy, so the reuse check can use it without loading torch); the worker side is in loop.py."""

from __future__ import annotations

import os

from training_core.errors import ConfigError
from training_core.train.config import TrainingConfig

FAULT_STEP_ENV = "TESSERA_FAULT_STEP"


def fault_step_from_env() -> int | None:
    """The chaos hook's step, or None when unset or empty; anything but a whole number ≥ 1 is
    refused before any worker starts."""
    raw = os.environ.get(FAULT_STEP_ENV, "").strip()
    if not raw:
        return None
    try:
        step = int(raw)
    except ValueError:
        step = 0
    if step < 1:
        raise ConfigError(f"{FAULT_STEP_ENV}={raw!r}: expected a training step number ≥ 1")
    return step


def fault_step_for(config: TrainingConfig) -> int | None:
    """The hook's step for a run of ``config``; one after the last step is refused (it would never fire)."""
    step = fault_step_from_env()
    if step is not None and step > config.max_steps:
        raise ConfigError(f"{FAULT_STEP_ENV}={step} would never fire: the run stops at max_steps={config.max_steps}")
    return step
