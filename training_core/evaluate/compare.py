"""Evaluate base vs trained (vs champion) models on a dataset's held-out split.

torch and transformers (`training_core.evaluate.metrics`) are imported when an evaluation runs:
the Dagster code location imports this module for `EvaluationReport`."""

from __future__ import annotations

from dataclasses import dataclass

from training_core.base_model import load_tokenizer
from training_core.evaluate.model_folder import check_trained_model_dir
from training_core.evaluate.results import EvalMetrics


@dataclass(frozen=True)
class EvaluationReport:
    base: EvalMetrics
    trained: EvalMetrics
    trained_model_dir: str
    mlflow_run_id: str
    champion: EvalMetrics | None = None

    @property
    def loss_ratio(self) -> float:
        return self.trained.loss / self.base.loss

    def as_metrics(self) -> dict[str, float]:
        champion = self.champion.as_dict("eval_champion_") if self.champion else {}
        return {**self.base.as_dict("eval_base_"), **self.trained.as_dict("eval_"), **champion,
                "eval_loss_ratio": self.loss_ratio}


def evaluate_trained(base_model_path: str, trained_model_dir: str, records: list[dict[str, str]], tokenizer=None) -> EvalMetrics:
    from training_core.evaluate.metrics import evaluate, load_model_for_eval

    tokenizer = tokenizer or load_tokenizer(base_model_path)
    return evaluate(load_model_for_eval(base_model_path, trained_model_dir), tokenizer, records)


def evaluate_against_base(base_model_path: str, trained_model_dir: str, records: list[dict[str, str]]) -> tuple[EvalMetrics, EvalMetrics]:
    from training_core.evaluate.metrics import evaluate, load_model_for_eval

    # Checked first: a damaged trained folder would otherwise fail only after the base model's evaluation.
    check_trained_model_dir(trained_model_dir)
    tokenizer = load_tokenizer(base_model_path)
    base = evaluate(load_model_for_eval(base_model_path), tokenizer, records)
    return base, evaluate_trained(base_model_path, trained_model_dir, records, tokenizer)
