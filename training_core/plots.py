"""PNG plots for MLflow artifacts and Dagster metadata (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from training_core.train.telemetry import STEP_PHASES  # noqa: E402


def plot_loss_curve(loss_history: list[tuple[int, float]], path: Path, title: str = "train loss") -> Path:
    figure, axis = plt.subplots(figsize=(6, 3.5), dpi=100)
    steps, losses = zip(*loss_history) if loss_history else ((), ())
    axis.plot(steps, losses, linewidth=1.5)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("loss")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def plot_step_time(telemetry: dict, path: Path) -> Path:
    phases = list(STEP_PHASES)
    figure, axis = plt.subplots(figsize=(6, 3), dpi=100)
    axis.barh(phases, [telemetry.get(f"{p}_s", 0.0) for p in phases], label="wall")
    # Wall minus the step thread's CPU time: waiting, mostly on collectives (CPU runs).
    axis.barh(phases, [telemetry.get(f"{p}_blocked_s", 0.0) for p in phases], label="of which blocked")
    axis.legend(fontsize=7)
    axis.set_xlabel("seconds (rank 0, whole run)")
    axis.set_title("step-time split")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path
