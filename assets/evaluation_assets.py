"""evaluation (+ gates) → promoted_model (MLflow registry alias `champion`)."""

import tempfile
from dataclasses import dataclass

import dagster as dg
from pydantic import Field

from assets.partitions import DAILY, TRAINING_WINDOW, by_partition
from assets.training_assets import TrainedModel
from resources import MlflowTracker
from training_core.base_model import BaseModelRef
from training_core.data.window import DatasetWindow
from training_core.errors import EmptyPartitionError
from training_core.evaluate.compare import EvaluationReport, evaluate_against_base, evaluate_trained
from training_core.tracking import ModelRegistry

REGISTERED_MODEL = "tessera-adapter"
CHAMPION_ALIAS = "champion"
# Defaults of EvaluationConfig. "Better than the base": held-out loss below the base model's.
MAX_LOSS_RATIO = 1.0
# "Not worse than the champion": at most 5 % higher held-out loss than the current champion.
CHAMPION_TOLERANCE = 0.05


class EvaluationConfig(dg.Config):
    """Promotion gates; the defaults promote only a model that beats the base and holds up against the champion.
    Dagster rejects a wrong type or unknown field at launch; a value out of range fails this step before any
    model is loaded."""

    # allow_inf_nan=False: NaN compares false with everything, so it would silently fail (or pass) every gate.
    max_loss_ratio: float = Field(
        MAX_LOSS_RATIO, gt=0, allow_inf_nan=False,
        description="beats_base_model passes when trained / base held-out loss is below this (1.0: below the base's)",
    )
    champion_tolerance: float = Field(
        CHAMPION_TOLERANCE, ge=0, allow_inf_nan=False,
        description="not_worse_than_champion passes when held-out loss ≤ champion's × (1 + this) "
        "(0.05: at most 5 % higher)",
    )


@dg.asset(
    partitions_def=DAILY,
    group_name="evaluation",
    ins={"training_dataset": dg.AssetIn(partition_mapping=TRAINING_WINDOW)},
    check_specs=[
        dg.AssetCheckSpec("beats_base_model", asset="evaluation", blocking=True,
                          description="the trained model's held-out loss is below max_loss_ratio × the base model's "
                                      f"(default {MAX_LOSS_RATIO}: below the base's)"),
        dg.AssetCheckSpec("not_worse_than_champion", asset="evaluation", blocking=True,
                          description="held-out loss at most champion_tolerance above the current champion's "
                                      f"(default {CHAMPION_TOLERANCE:.0%})"),
    ],
)
def evaluation(
    context: dg.AssetExecutionContext,
    config: EvaluationConfig,
    mlflow_tracker: MlflowTracker,
    training_dataset,
    base_model: BaseModelRef,
    lora_adapter: TrainedModel,
):
    """Eval loss, perplexity and exact-match on the training window's held-out prompts: base vs trained vs
    champion. Blocking checks stop promotion when training did not help."""
    window = DatasetWindow.from_partitions(by_partition(training_dataset, context, "training_dataset"))
    if lora_adapter.dataset_digest != window.digest:
        raise ValueError(
            f"lora_adapter was trained on datasets {lora_adapter.dataset_digest[:12]} but evaluation got "
            f"{window.digest[:12]}; rematerialize lora_adapter for partition {context.partition_key}"
        )
    records = window.eval_records()
    if not records:  # datasets published before the writer refused an empty eval split
        raise EmptyPartitionError(
            f"training_dataset partitions {', '.join(window.partition_keys)}: no held-out (eval) records to evaluate "
            "on; rematerialize them with a larger eval_fraction or more records"
        )
    base, trained = evaluate_against_base(base_model.name_or_path, lora_adapter.model_dir, records)
    tracking = mlflow_tracker.client()
    registry = ModelRegistry(tracking, REGISTERED_MODEL, CHAMPION_ALIAS)
    champion = registry.champion()
    champion_metrics = None
    if champion is not None and champion.run_id != lora_adapter.mlflow_run_id:  # a reused run often is it
        with tempfile.TemporaryDirectory() as tmp:
            champion_metrics = evaluate_trained(*registry.download(champion, tmp), records)
    report = EvaluationReport(base, trained, lora_adapter.model_dir, lora_adapter.mlflow_run_id, champion_metrics)
    tracking.log_metrics(lora_adapter.mlflow_run_id, report.as_metrics())
    yield dg.Output(report, metadata={k: float(v) for k, v in report.as_metrics().items()})
    yield _beats_base_model(report, config.max_loss_ratio)
    yield _not_worse_than_champion(report, champion.run_id if champion else None, config.champion_tolerance)


def _beats_base_model(report: EvaluationReport, max_loss_ratio: float) -> dg.AssetCheckResult:
    ratio = report.loss_ratio
    return dg.AssetCheckResult(
        check_name="beats_base_model",
        passed=bool(ratio < max_loss_ratio),
        metadata={"loss_ratio": ratio, "base_loss": report.base.loss, "trained_loss": report.trained.loss,
                  "exact_match": report.trained.exact_match},
        description=f"eval loss ratio {ratio:.3f} (must be < {max_loss_ratio})",
    )


def _not_worse_than_champion(report: EvaluationReport, champion_run: str | None,
                             champion_tolerance: float) -> dg.AssetCheckResult:
    if report.champion is None:
        reason = "no champion yet" if champion_run is None else "this run is the champion"
        return dg.AssetCheckResult(check_name="not_worse_than_champion", passed=True, description=reason)
    limit = report.champion.loss * (1 + champion_tolerance)
    return dg.AssetCheckResult(
        check_name="not_worse_than_champion",
        passed=bool(report.trained.loss <= limit),
        metadata={"trained_loss": report.trained.loss, "champion_loss": report.champion.loss,
                  "champion_run_id": champion_run or ""},
        description=f"eval loss {report.trained.loss:.4f} vs champion {report.champion.loss:.4f} (limit {limit:.4f})",
    )


@dataclass(frozen=True)
class PromotedModel:
    name: str
    version: str
    alias: str
    run_id: str


@dg.asset(partitions_def=DAILY, group_name="evaluation", kinds={"mlflow"})
def promoted_model(context: dg.AssetExecutionContext, mlflow_tracker: MlflowTracker, evaluation: EvaluationReport):
    """Registers the trained model and points `champion` at it. Runs only when every blocking
    check upstream passed; promoting the current champion again is a no-op."""
    registry = ModelRegistry(mlflow_tracker.client(), REGISTERED_MODEL, CHAMPION_ALIAS)
    version, changed = registry.promote(evaluation.mlflow_run_id)
    context.log.info("%s version %s is %s %s", REGISTERED_MODEL, version, "now" if changed else "still", CHAMPION_ALIAS)
    return dg.Output(
        PromotedModel(REGISTERED_MODEL, version, CHAMPION_ALIAS, evaluation.mlflow_run_id),
        metadata={"registered_model": REGISTERED_MODEL, "version": version, "alias": CHAMPION_ALIAS,
                  "alias_moved": changed, "mlflow_run_id": evaluation.mlflow_run_id},
    )
