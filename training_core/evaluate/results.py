"""Evaluation results (no torch: the Dagster side imports them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class EvalMetrics:
    loss: float
    perplexity: float
    exact_match: float
    examples: int

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        return {f"{prefix}{k}": v for k, v in asdict(self).items()}
