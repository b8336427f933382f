"""What a finished training run hands back to its caller (no torch: the Dagster side imports it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainingResult:
    run_name: str
    model_dir: str  # adapter (lora/qlora) or full model, copied out of Ray storage
    steps: int
    restarts: int
    loss_history: list[tuple[int, float]]
    telemetry: dict
    deepspeed_config: dict
