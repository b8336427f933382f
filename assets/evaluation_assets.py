"""evaluation (+ gates) → promoted_model (MLflow registry alias `champion`)."""

import hashlib
import json
import math
from dataclasses import dataclass, replace
from typing import Literal

import dagster as dg
from dagster_ray import RayResource
from pydantic import Field, field_validator

from assets.backfills import day_added_to_this_backfill
from assets.partitions import DAILY, TRAINING_WINDOW, by_partition, daily_blocking_check
from assets.step_start import start_step
from assets.training_assets import TrainedModel
from resources import MlflowTracker, TesseraStorage
from resources.ray_cluster import connect_unless_connected, gpu_available_in_cluster
from training_core.base_model import BaseModelRef, HubRevision
from training_core.data.window import DatasetWindow
from training_core.errors import ConfigError, EmptyPartitionError, LineageError
from training_core.evaluate.compare import (
    CHAMPION_UNRECORDED, EvaluationJob, EvaluationReport, champion_not_comparable, run_evaluation,
)
from training_core.evaluate.settings import EvalSettings
from training_core.storage import staging_directory
from training_core.registry import ModelRegistry

REGISTERED_MODEL = "tessera-adapter"
CHAMPION_ALIAS = "champion"
# Defaults of EvaluationConfig. "Better than the base": held-out loss below the base model's.
MAX_LOSS_RATIO = 1.0
# "Not worse than the champion": at most 5 % higher held-out loss than the current champion.
CHAMPION_TOLERANCE = 0.05
# ...or at most this many nats per token above it, whichever is more: near a loss of 0 (a memorized task, the
# demo's 0.0055) 5 % is a rounding error, and every later day's model would fail the gate. A tolerance of 0 is strict.
CHAMPION_SLACK_NATS = 0.01
# The loosest max_loss_ratio: a trained model with twice the base's loss. Above it, a gate set as a percentage.
MAX_LOSS_RATIO_LIMIT = 2.0
# Said of a champion that cannot be compared: the gate passes, so it does not hold on to the alias.
_REPLACED = f"a model that passes the other gate replaces it as {CHAMPION_ALIAS}"


class EvaluationConfig(dg.Config):
    """Promotion gates; the defaults promote only a model that beats the base and holds up against the champion.
    Dagster rejects a wrong type or unknown field at launch; a value out of range, or a device / precision this
    machine cannot evaluate with in the step's process, fails the run's first step (assets/launch_checks.py),
    before anything is trained."""

    # allow_inf_nan=False: NaN compares false with everything, so it would silently fail (or pass) every gate.
    max_loss_ratio: float = Field(
        MAX_LOSS_RATIO, gt=0, allow_inf_nan=False,
        description="beats_base_model passes when trained / base held-out loss is below this (1.0: below the "
        f"base's; 0.95: at least 5 % below); at most {MAX_LOSS_RATIO_LIMIT:g}",
    )
    champion_tolerance: float = Field(
        CHAMPION_TOLERANCE, ge=0, allow_inf_nan=False,
        description="not_worse_than_champion passes when held-out loss ≤ champion's × (1 + this) "
        f"(0.05: at most 5 % higher), or ≤ champion's + {CHAMPION_SLACK_NATS:g} if that is more (0: no higher); "
        "a fraction below 1",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the models are evaluated: 'auto' is the GPU when the evaluating process "
        "sees one (with on_ray_cluster, when the Ray cluster has one), else the CPU",
    )
    precision: Literal["fp32", "bf16"] = Field("fp32", description="weights' dtype while evaluating; bf16 needs a GPU")
    batch_size: int = Field(64, ge=1, description="held-out examples per forward pass and per generate() call")
    on_ray_cluster: bool = Field(
        False, description="evaluate in a task on the training's Ray cluster (e.g. on its GPUs) instead of in this "
        "step's process; model folders must be on storage the cluster shares",
    )

    # A percentage typed where a fraction or ratio belongs (5 for "5 %") turned a gate off without a word.
    @field_validator("max_loss_ratio")
    @classmethod
    def _a_ratio(cls, value: float) -> float:
        if value > MAX_LOSS_RATIO_LIMIT:
            raise ValueError(f"is a ratio of held-out losses, trained / base (1.0: below the base's loss; 0.95: at "
                             f"least 5 % below it), at most {MAX_LOSS_RATIO_LIMIT:g}; got {value!r}")
        return value

    @field_validator("champion_tolerance")
    @classmethod
    def _a_fraction(cls, value: float) -> float:
        if value >= 1:
            raise ValueError(f"is a fraction below 1 (0.05 means 5 %: at most 5 % higher loss than the champion's); "
                             f"got {value!r}")
        return value

    def settings(self) -> EvalSettings:
        return EvalSettings(self.device, self.precision, self.batch_size)

    def settings_this_machine_can_run(self) -> EvalSettings:
        """The settings, refused when this step's own process is to evaluate and this machine has no GPU for
        them (checked at launch, not after training). A Ray task may get a GPU this machine lacks: not checked."""
        settings = self.settings()
        if self.on_ray_cluster or (settings.device != "cuda" and settings.precision != "bf16"):
            return settings  # nothing to check: torch is not imported for it
        try:
            return settings.for_this_process()
        except ConfigError as error:
            raise ConfigError(f"{error}, or on_ray_cluster: true to evaluate in a task on the Ray cluster (its GPUs)"
                              ) from error


@dg.asset(
    partitions_def=DAILY,
    group_name="evaluation",
    ins={"training_dataset": dg.AssetIn(partition_mapping=TRAINING_WINDOW)},
    check_specs=[
        daily_blocking_check("beats_base_model", "evaluation",
                             "the trained model's held-out loss is below max_loss_ratio × the base model's "
                             f"(default {MAX_LOSS_RATIO}: below the base's)"),
        daily_blocking_check("not_worse_than_champion", "evaluation",
                             "held-out loss at most champion_tolerance above the current champion's "
                             f"(default {CHAMPION_TOLERANCE:.0%}), or {CHAMPION_SLACK_NATS:g} nats where that is "
                             "more"),
    ],
)
def evaluation(
    context: dg.AssetExecutionContext,
    config: EvaluationConfig,
    mlflow_tracker: MlflowTracker,
    storage: TesseraStorage,
    ray_cluster: RayResource,
    training_dataset,
    base_model: BaseModelRef,
    lora_adapter: TrainedModel,
):
    """Eval loss, perplexity and exact-match on the training window's held-out prompts: base vs trained vs
    champion. Blocking checks stop promotion when training did not help."""
    start_step(context)
    if added := day_added_to_this_backfill(context):  # its window, like lora_adapter's, pulls in the next day
        raise dg.Failure(added)  # not ending without output, as lora_adapter does: its gates are required outputs
    window = DatasetWindow.from_partitions(by_partition(training_dataset, context, "training_dataset"))
    if lora_adapter.dataset_digest != window.digest:
        raise ValueError(
            f"lora_adapter was trained on datasets {lora_adapter.dataset_digest[:12]} but evaluation got "
            f"{window.digest[:12]}; rematerialize lora_adapter for partition {context.partition_key}"
        )
    tracking = mlflow_tracker.client()
    _refuse_another_base_model(lora_adapter, base_model, tracking, context.partition_key)
    records = window.eval_records()
    if not records:  # datasets published before the writer refused an empty eval split
        raise EmptyPartitionError(
            f"training_dataset partitions {', '.join(window.partition_keys)}: no held-out (eval) records to evaluate "
            "on; rematerialize them with a larger eval_fraction or more records"
        )
    settings = config.settings()  # a bad combination fails here, before a model is loaded
    registry = ModelRegistry(tracking, REGISTERED_MODEL, CHAMPION_ALIAS, base_digest_records=storage.base_model_digests)
    champion = registry.champion()
    # A reused run often is the champion: nothing to compare against. Another tokenizer, or its MLflow run
    # gone: no comparison.
    compare = champion is not None and champion.run_id != lora_adapter.mlflow_run_id
    champion_base, not_comparable = (_champion_base_model(registry, champion, base_model.name_or_path) if compare
                                     else (None, None))
    # Downloaded into the state folder, not /tmp: a Ray task on another node reads it from there.
    with staging_directory(storage.folder("models") / "champion-downloads") as downloads:
        champion_model = None
        if compare and not not_comparable:
            try:
                champion_model = (champion_base, registry.download(champion, downloads))
            except LineageError as error:  # artifacts deleted: that champion cannot be served either
                not_comparable = f"{error}; {_REPLACED}"
        if not_comparable:
            context.log.warning("not comparing with the champion (run %s): %s", champion.run_id, not_comparable)
        job = EvaluationJob(base_model.name_or_path, lora_adapter.model_dir, records, settings, champion_model,
                            window.prompt_format)
        if config.on_ray_cluster:
            from training_core.evaluate.on_ray import evaluate_on_ray

            connect_unless_connected(ray_cluster, context)
            outcome = evaluate_on_ray(job, gpu_available_in_cluster())
        else:
            outcome = run_evaluation(job)
    report = EvaluationReport(outcome.base, outcome.trained, lora_adapter.model_dir, lora_adapter.mlflow_run_id,
                              outcome.champion, champion_run_id=champion.run_id if champion else None)
    gates = [_beats_base_model(report, config.max_loss_ratio),
             _not_worse_than_champion(report, champion.run_id if champion else None, config.champion_tolerance,
                                      not_comparable)]
    report = replace(report, failed_gates=tuple(gate.check_name for gate in gates if not gate.passed))
    # The settings beside the metrics they produced: `tessera reproduce` evaluates with them.
    tracking.log_batch(lora_adapter.mlflow_run_id, metrics=report.as_metrics(), tags=outcome.settings.as_tags())
    context.log.info("evaluated on %s in %s, batch size %d, by %s%s", outcome.settings.device,
                     outcome.settings.precision, outcome.settings.batch_size, outcome.where,
                     " (a Ray task)" if config.on_ray_cluster else "")
    yield dg.Output(report, metadata={**{k: float(v) for k, v in report.as_metrics().items()},
                                      "eval_device": outcome.settings.device,
                                      "eval_precision": outcome.settings.precision,
                                      "evaluated_by": outcome.where},
                    data_version=evaluation_data_version(report))
    yield from gates


def _refuse_another_base_model(lora_adapter: TrainedModel, base_model: BaseModelRef, tracking,
                               partition_key: str) -> None:
    """The adapter is scored over the current base_model: one trained on another base would be scored as a
    model it never was, and those metrics would overwrite its training run's. Refused before anything is
    logged. A TrainedModel stored before it carried the digest is checked against its run's lineage record."""
    trained_on = lora_adapter.base_model_digest or tracking.client.get_run(
        lora_adapter.mlflow_run_id).data.params.get("base_model_digest", "")
    if trained_on and trained_on != base_model.digest:
        raise LineageError(
            f"lora_adapter of partition {partition_key} (MLflow run {lora_adapter.mlflow_run_id}) was trained on base "
            f"model {lora_adapter.base_model} (digest {_short(trained_on)}), but base_model is now "
            f"{base_model.name_or_path} (digest {_short(base_model.digest)}); rematerialize lora_adapter for partition "
            f"{partition_key} to train on it (nothing was evaluated or logged)"
        )


def _short(digest: str) -> str:
    """A content digest's first 12 hex digits; a hub digest whole (repo and commit)."""
    return digest if HubRevision.from_digest(digest) else digest[:12]


def evaluation_data_version(report: EvaluationReport) -> dg.DataVersion:
    """What promotion reads: which run, its scores and failed gates. A reused training run scored the
    same again keeps promoted_model fresh (Dagster would otherwise give every materialization a new version)."""
    recorded = {"mlflow_run_id": report.mlflow_run_id, "metrics": {k: float(v) for k, v in report.as_metrics().items()},
                "failed_gates": report.failed_gates}
    return dg.DataVersion(hashlib.sha256(json.dumps(recorded, sort_keys=True).encode()).hexdigest())


def _champion_base_model(registry: ModelRegistry, champion, base_model: str) -> tuple[str | None, str | None]:
    """(the champion's base model, why the champion cannot be compared with this run's model or None).
    A champion whose MLflow run is gone (deleted, then garbage-collected) or recorded no base model
    is not comparable, like one that tokenizes differently: the gate passes saying why, not the step failing."""
    try:
        champion_base = registry.base_model_of(champion)
    except LineageError as error:
        return None, f"{error}; {_REPLACED}"
    return champion_base, champion_not_comparable(champion_base, base_model)


def _beats_base_model(report: EvaluationReport, max_loss_ratio: float) -> dg.AssetCheckResult:
    ratio = report.loss_ratio
    return dg.AssetCheckResult(
        check_name="beats_base_model",
        passed=bool(ratio < max_loss_ratio),
        metadata={"loss_ratio": ratio, "base_loss": report.base.loss, "trained_loss": report.trained.loss,
                  "exact_match": report.trained.exact_match},
        description=f"eval loss ratio {ratio:.3f} (must be < {max_loss_ratio})",
    )


def _not_worse_than_champion(report: EvaluationReport, champion_run: str | None, champion_tolerance: float,
                             not_comparable: str | None = None) -> dg.AssetCheckResult:
    if report.champion is not None and not math.isfinite(report.champion.loss):
        not_comparable = (f"the champion scores a held-out loss of {report.champion.loss} on these records, which no "
                          f"loss compares with; {_REPLACED}")
    if report.champion is None or not_comparable:
        reason = ("no champion yet" if champion_run is None else f"not compared: {not_comparable}" if not_comparable
                  else "this run is the champion")
        return dg.AssetCheckResult(check_name="not_worse_than_champion", passed=True, description=reason,
                                   metadata={"compared": False, "champion_run_id": champion_run or ""})
    slack = max(report.champion.loss * champion_tolerance, CHAMPION_SLACK_NATS) if champion_tolerance > 0 else 0.0
    limit = report.champion.loss + slack
    return dg.AssetCheckResult(
        check_name="not_worse_than_champion",
        passed=bool(report.trained.loss <= limit),
        metadata={"compared": True, "trained_loss": report.trained.loss, "champion_loss": report.champion.loss,
                  "champion_run_id": champion_run or ""},
        description=f"eval loss {report.trained.loss:.4f} vs champion {report.champion.loss:.4f} (limit {limit:.4f})",
    )


@dataclass(frozen=True)
class PromotedModel:
    """The registered version `champion` points at after this partition's promotion."""

    name: str
    version: str
    alias: str
    run_id: str


class PromotionConfig(dg.Config):
    """When a model that passed its gates still leaves `champion` where it is, saying why in the step's
    metadata (`alias_moved: false`, `alias_kept_because`)."""

    allow_older_day: bool = Field(
        False, description="promote a model of a day older than the champion's day (a deliberate rollback); "
        f"otherwise a backfill or re-run of an earlier day leaves {CHAMPION_ALIAS} on the later day's model",
    )


@dg.asset(partitions_def=DAILY, group_name="evaluation", kinds={"mlflow"})
def promoted_model(context: dg.AssetExecutionContext, config: PromotionConfig, mlflow_tracker: MlflowTracker,
                   evaluation: EvaluationReport):
    """Registers the trained model and points `champion` at it. Runs only when every blocking
    check upstream passed; promoting the current champion again is a no-op. A model of a day older
    than the champion's leaves the champion alone unless config says otherwise."""
    start_step(context)
    # Blocking checks stop this step in the run that evaluated; a promotion launched on its own (UI,
    # backfill) gets here anyway, so it reads the gates off the evaluation it would promote.
    if evaluation.failed_gates is None:
        raise dg.Failure(
            f"the evaluation of partition {context.partition_key} (MLflow run {evaluation.mlflow_run_id}) carries "
            f"no gate results (stored before gates were recorded); rematerialize evaluation for this partition, "
            f"then promoted_model; {CHAMPION_ALIAS} stays where it is"
        )
    if evaluation.failed_gates:
        raise dg.Failure(
            f"not promoting MLflow run {evaluation.mlflow_run_id}: the latest evaluation of partition "
            f"{context.partition_key} failed {', '.join(evaluation.failed_gates)}; {CHAMPION_ALIAS} stays where it "
            "is (see that evaluation's asset checks, or rematerialize evaluation with other gate settings)"
        )
    if evaluation.champion_run_id == CHAMPION_UNRECORDED:
        raise dg.Failure(
            f"the evaluation of partition {context.partition_key} (MLflow run {evaluation.mlflow_run_id}) does not "
            f"record which {CHAMPION_ALIAS} it was compared with (stored before that was recorded); rematerialize "
            f"evaluation for this partition, then promoted_model; {CHAMPION_ALIAS} stays where it is"
        )
    registry = ModelRegistry(mlflow_tracker.client(), REGISTERED_MODEL, CHAMPION_ALIAS)
    _refuse_if_champion_moved(registry, evaluation, context.partition_key)
    champion = registry.champion()
    # A champion evaluation could not score (artifacts or base gone, a NaN loss) is replaced whatever its day.
    compared = evaluation.champion is not None and math.isfinite(evaluation.champion.loss)
    if compared and champion is not None and champion.run_id != evaluation.mlflow_run_id:
        if kept_because := _why_champion_stays(context, config, registry, champion, evaluation.mlflow_run_id):
            context.log.info("%s stays %s version %s: %s", CHAMPION_ALIAS, REGISTERED_MODEL, champion.version,
                             kept_because)
            kept = PromotedModel(REGISTERED_MODEL, str(champion.version), CHAMPION_ALIAS, champion.run_id)
            return dg.Output(
                kept,
                data_version=promotion_data_version(kept),
                metadata={"registered_model": REGISTERED_MODEL, "version": kept.version, "alias": CHAMPION_ALIAS,
                          "alias_moved": False, "alias_kept_because": kept_because, "mlflow_run_id": champion.run_id,
                          "candidate_run_id": evaluation.mlflow_run_id},
            )
    version, changed = registry.promote(evaluation.mlflow_run_id)
    context.log.info("%s version %s is %s %s", REGISTERED_MODEL, version, "now" if changed else "still", CHAMPION_ALIAS)
    promoted = PromotedModel(REGISTERED_MODEL, version, CHAMPION_ALIAS, evaluation.mlflow_run_id)
    return dg.Output(
        promoted,
        data_version=promotion_data_version(promoted),
        metadata={"registered_model": REGISTERED_MODEL, "version": version, "alias": CHAMPION_ALIAS,
                  "alias_moved": changed, "mlflow_run_id": evaluation.mlflow_run_id,
                  "model_kind": registry.model_kind(evaluation.mlflow_run_id)},
    )


def _why_champion_stays(context: dg.AssetExecutionContext, config: PromotionConfig, registry: ModelRegistry,
                        champion, run_id: str) -> str | None:
    """Why a candidate that passed its gates does not replace `champion` (another run), or None."""
    held_by = f"{REGISTERED_MODEL} version {champion.version} (MLflow run {champion.run_id})"
    champion_day = registry.trained_for_day(champion)
    # Daily partition keys are ISO dates: string order is date order.
    if not config.allow_older_day and champion_day is not None and context.partition_key < champion_day:
        return (f"partition {context.partition_key} (MLflow run {run_id}) is older than {champion_day}, the day "
                f"{CHAMPION_ALIAS} {held_by} trained for; an earlier day's model does not replace a later day's "
                "(promoted_model config allow_older_day: true rolls back to it)")
    return None


def promotion_data_version(promoted: PromotedModel) -> dg.DataVersion:
    """The registered version and the run it holds: promoting the champion again keeps its version."""
    return dg.DataVersion(f"{promoted.name}/{promoted.version}/{promoted.run_id}")


def _refuse_if_champion_moved(registry: ModelRegistry, evaluation: EvaluationReport, partition_key: str) -> None:
    """The gate compared this model with the champion of its evaluation; a champion promoted since
    (another day of a backfill, a run launched in parallel) was never compared with it, so moving
    the alias now could replace a better model. Promoting the current champion again stays a no-op."""
    current = registry.champion()
    current_run = current.run_id if current is not None else None
    if current_run in (evaluation.champion_run_id, evaluation.mlflow_run_id):
        return
    compared = (f"champion run {evaluation.champion_run_id}" if evaluation.champion_run_id
                else f"no {CHAMPION_ALIAS} (there was none yet)")
    now = f"{REGISTERED_MODEL} version {current.version} (MLflow run {current_run})" if current is not None else "none"
    raise dg.Failure(
        f"not promoting MLflow run {evaluation.mlflow_run_id}: the evaluation of partition {partition_key} compared it "
        f"with {compared}, but {CHAMPION_ALIAS} is now {now}; rematerialize evaluation for this partition, then "
        f"promoted_model, to compare with the current {CHAMPION_ALIAS}; {CHAMPION_ALIAS} stays where it is"
    )
