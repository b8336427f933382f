"""evaluation (+ gate) → promoted_model (MLflow registry alias `champion`)."""


from dataclasses import dataclass

import dagster as dg

from assets.partitions import DAILY
from assets.training_assets import TrainedModel
from resources import MlflowTracker
from training_core.base_model import BaseModelRef
from training_core.data.dataset_writer import PublishedDataset, read_eval_records
from training_core.evaluate.compare import EvaluationReport, evaluate_against_base

REGISTERED_MODEL = "tessera-adapter"
CHAMPION_ALIAS = "champion"
# "Better than the base": the trained model's held-out loss must be below the base model's.
MAX_LOSS_RATIO = 1.0


@dg.asset(
    partitions_def=DAILY,
    group_name="evaluation",
    check_specs=[dg.AssetCheckSpec("beats_base_model", asset="evaluation", blocking=True,
                                   description="the trained model's held-out loss is below the base model's")],
)
def evaluation(
    context: dg.AssetExecutionContext,
    mlflow_tracker: MlflowTracker,
    training_dataset: PublishedDataset,
    base_model: BaseModelRef,
    lora_adapter: TrainedModel,
):
    """Eval loss, perplexity and exact-match on the dataset's held-out prompts: base vs trained.
    The blocking check `beats_base_model` stops promotion when training did not help."""
    if lora_adapter.dataset_digest != training_dataset.digest:
        raise ValueError(
            f"lora_adapter was trained on dataset {lora_adapter.dataset_digest[:12]} but evaluation got "
            f"{training_dataset.digest[:12]}; rematerialize lora_adapter for partition {context.partition_key}"
        )
    base, trained = evaluate_against_base(base_model.name_or_path, lora_adapter.model_dir, read_eval_records(training_dataset.path))
    report = EvaluationReport(base, trained, lora_adapter.model_dir, lora_adapter.mlflow_run_id)
    mlflow_tracker.client().log_metrics(lora_adapter.mlflow_run_id, report.as_metrics())
    yield dg.Output(report, metadata={k: float(v) for k, v in report.as_metrics().items()})
    yield beats_base_model(report)


def beats_base_model(report: EvaluationReport) -> dg.AssetCheckResult:
    ratio = report.loss_ratio
    return dg.AssetCheckResult(
        check_name="beats_base_model",
        passed=bool(ratio < MAX_LOSS_RATIO),
        metadata={"loss_ratio": ratio, "base_loss": report.base.loss, "trained_loss": report.trained.loss,
                  "exact_match": report.trained.exact_match},
        description=f"eval loss ratio {ratio:.3f} (must be < {MAX_LOSS_RATIO})",
    )


@dataclass(frozen=True)
class PromotedModel:
    name: str
    version: str
    alias: str


@dg.asset(partitions_def=DAILY, group_name="evaluation", kinds={"mlflow"})
def promoted_model(context: dg.AssetExecutionContext, mlflow_tracker: MlflowTracker, evaluation: EvaluationReport):
    """Registers the trained model and points the `champion` alias at it (only after checks pass)."""
    client = mlflow_tracker.client().client
    try:
        client.get_registered_model(REGISTERED_MODEL)
    except Exception:  # MlflowException(RESOURCE_DOES_NOT_EXIST)
        client.create_registered_model(REGISTERED_MODEL)
    run = client.get_run(evaluation.mlflow_run_id)
    version = client.create_model_version(REGISTERED_MODEL, f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
    client.set_registered_model_alias(REGISTERED_MODEL, CHAMPION_ALIAS, version.version)
    context.log.info("%s version %s is now %s", REGISTERED_MODEL, version.version, CHAMPION_ALIAS)
    return dg.Output(
        PromotedModel(REGISTERED_MODEL, str(version.version), CHAMPION_ALIAS),
        metadata={"registered_model": REGISTERED_MODEL, "version": str(version.version), "alias": CHAMPION_ALIAS},
    )
