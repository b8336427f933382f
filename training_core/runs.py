"""A tracked training run: lineage record → MLflow run → Ray training → logged results.

Used by the `lora_adapter` asset and by `tessera reproduce`, so both record runs the same way. The
launcher (torch, transformers, DeepSpeed) is imported only when a run trains: the Dagster code
location imports this module."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from training_core.base_model import base_model_changes
from training_core.data.dataset_writer import read_prompt_format
from training_core.errors import ConfigError, LineageError
from training_core.lineage import build_lineage_record
from training_core.storage import changed_files
from training_core.tracking import MlflowTracking, interruption
from training_core.train.config import TrainingConfig
from training_core.train.fault_injection import FAULT_STEP_ENV, fault_step_for
from training_core.train.result import TrainingResult
from training_core.train.worker_code import CodeIdentity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingInputs:
    """The exact inputs of one run; with the config and seeds they determine the result on CPU."""

    base_model: str
    base_model_digest: str
    dataset_paths: list[str]  # published datasets of the training window, oldest first
    dataset_digest: str  # window_digest of their digests
    seq_len: int
    cache_directory: str | None
    cache_version: str
    partition_keys: list[str] = field(default_factory=list)
    # How the cache was warmed (the cache resource's quota and policy); None: the training config's quota.
    cache_size_limit_bytes: int | None = None
    cache_policy: str = "evict"


def check_inputs_are_as_recorded(inputs: TrainingInputs, base_digest_records: Path | None = None,
                                 base_model_checked: bool = False) -> None:
    """The base model and datasets still are what their digests say, and every dataset was tokenized
    with this base model. Checked before a finished run is reused or a new one trains: a base-model
    folder overwritten in place kept its old digest (a reuse would hand back a model trained on the
    old weights), and a window mixing days tokenized by different base models trains on token ids
    the model does not have (an IndexError inside a worker, or silently wrong embeddings).
    ``base_model_checked``: the caller just compared the base model with its digest (hashing a 7B
    model's folder again would read ~14 GB twice)."""
    base = Path(inputs.base_model)
    if not base_model_checked and not inputs.base_model_digest.startswith("hub:") and base.is_dir():
        if changes := base_model_changes(base, inputs.base_model_digest, base_digest_records):
            raise LineageError(
                f"base model {base} changed since base_model was materialized ({', '.join(changes)}); "
                "rematerialize base_model and the training_dataset partitions it tokenized")
    keys = inputs.partition_keys if len(inputs.partition_keys) == len(inputs.dataset_paths) else inputs.dataset_paths
    stale = []
    for key, path in zip(keys, inputs.dataset_paths):
        try:
            tokenized_with = json.loads((Path(path) / "manifest.json").read_text()).get("tokenizer")
        except (OSError, ValueError) as error:
            if not Path(path).exists():  # pruned, or the state folder's datasets/ removed
                raise LineageError(f"training dataset {path} is gone; rematerialize training_dataset for "
                                   f"{key if key != path else 'its partition'}") from None
            raise LineageError(f"training dataset {path}: manifest.json is not readable ({error})") from error
        if tokenized_with is not None and tokenized_with != inputs.base_model_digest:  # None: written before it was recorded
            stale.append(f"{key} (tokenized with base model {tokenized_with[:12]})")
    if stale:
        raise LineageError(
            f"training_dataset {', '.join(stale)} was not tokenized with the base model being trained, {inputs.base_model} "
            f"({inputs.base_model_digest[:12]}); rematerialize training_dataset for "
            f"{'that partition' if len(stale) == 1 else 'those partitions'} with the current base_model")


@dataclass(frozen=True)
class TrackedRun:
    mlflow_run_id: str
    result: TrainingResult
    lineage: dict[str, str]
    reused: bool = False  # an earlier finished run had the same inputs, config and code


# Inputs that fully determine a CPU training result; equal values ⇒ the earlier result is reused
# (and the same Ray run name resumes its checkpoints). The environment digest covers the library
# versions (lineage.TRACKED_PACKAGES): runs recorded before it are not reused, they train once more.
REUSE_KEYS = ("dataset_digest", "base_model_digest", "config_digest", "code_version", "cache_version",
              "environment_digest")


def find_reusable_run(tracking: MlflowTracking, lineage: dict[str, str]) -> TrackedRun | None:
    """A finished, non-reproduction run with the same inputs whose model folder is still as
    published (every file matches the digest recorded then)."""
    for run in _finished_runs_with(tracking, lineage):
        model_dir = run.data.tags.get("model_dir")
        if "reproduces" in run.data.tags or not model_dir or not Path(model_dir).is_dir():
            continue
        if (damage := changed_files(Path(model_dir))) != []:
            log.warning("MLflow run %s matches, but its model %s is not as published (%s): training again",
                        run.info.run_id, model_dir, ", ".join(damage) if damage else "no digest record")
            continue
        history = tracking.loss_history(run.info.run_id)
        metrics = run.data.metrics
        result = TrainingResult(
            run_name=run.info.run_name, model_dir=model_dir, steps=int(metrics.get("steps", len(history))),
            restarts=int(metrics.get("restarts", 0)), loss_history=history,
            telemetry=dict(metrics), deepspeed_config={},
        )
        return TrackedRun(mlflow_run_id=run.info.run_id, result=result, lineage=dict(run.data.params), reused=True)
    return None


def _finished_runs_with(tracking: MlflowTracking, lineage: dict[str, str], page_size: int = 50):
    """Finished runs with these `REUSE_KEYS` values, newest first, page by page: every reproduction of
    a run shares its lineage, so a first page alone may hold nothing but reproductions."""
    clauses = [f"params.{key} = '{lineage[key]}'" for key in REUSE_KEYS] + ["attributes.status = 'FINISHED'"]
    page_token = None
    while True:
        page = tracking.client.search_runs([tracking.experiment_id], filter_string=" and ".join(clauses),
                                           order_by=["attributes.start_time DESC"], max_results=page_size,
                                           page_token=page_token)
        yield from page
        if not page.token:
            return
        page_token = page.token


def ray_run_name(inputs: TrainingInputs, lineage: dict[str, str], suffix: str = "") -> str:
    """Deterministic in everything that determines the result (`REUSE_KEYS`, code version
    included), so relaunching the same work resumes its checkpoints, and a code or cache change
    starts a fresh run instead of finishing an old one's checkpoint."""
    partitions = "+".join(inputs.partition_keys) or "all"
    determined_by = hashlib.sha256(json.dumps([lineage[key] for key in REUSE_KEYS]).encode()).hexdigest()
    name = f"train-{partitions}-{inputs.dataset_digest[:8]}-{determined_by[:12]}"
    return f"{name}-{suffix}" if suffix else name


def run_tracked_training(
    config: TrainingConfig,
    inputs: TrainingInputs,
    tracking: MlflowTracking,
    *,
    ray_storage: str,
    models_dir: Path,
    dagster_run_id: str = "",
    extra_tags: dict[str, str] | None = None,
    run_name_suffix: str = "",
    reuse_finished: bool = True,
    before_training: Callable[[], None] | None = None,
    base_digest_records: Path | None = None,
    base_model_checked: bool = False,
    run_has_ended: Callable[[str], str | None] | None = None,
) -> TrackedRun:
    """Reuse a finished run with identical inputs, or train. `before_training` runs only when
    training really starts (the asset connects to Ray there, so a reuse never starts Ray), after
    the checks that need no Ray (`check_before_launch`) passed.
    ``base_model_checked``: see :func:`check_inputs_are_as_recorded`; ``run_has_ended``: see
    :meth:`MlflowTracking.end_abandoned_runs`."""
    lineage = build_lineage_record(
        seed=config.seed,
        data_seed=config.data_seed,
        dataset_digest=inputs.dataset_digest,
        dataset_paths=inputs.dataset_paths,
        cache_version=inputs.cache_version,
        base_model=inputs.base_model,
        base_model_digest=inputs.base_model_digest,
        config_digest=config.digest(),
        dagster_run_id=dagster_run_id,
        partition_keys=inputs.partition_keys,
    )
    check_inputs_are_as_recorded(inputs, base_digest_records, base_model_checked)
    fault_step = fault_step_for(config)
    if reuse_finished and (earlier := find_reusable_run(tracking, lineage)) is not None:
        if fault_step is not None:  # a reuse trains nothing: the hook would pass without firing
            raise ConfigError(
                f"{FAULT_STEP_ENV}={fault_step} is set, but inputs, config and code are unchanged since MLflow run "
                f"{earlier.mlflow_run_id}, which would be reused: nothing trains, so no worker would be killed. "
                "Use an empty state folder (TESSERA_HOME, or --home) or another seed to train with the fault"
            )
        log.info("inputs, config and code unchanged since MLflow run %s: reusing it", earlier.mlflow_run_id)
        return earlier
    # Imported before `before_training` starts Ray: a fresh local Ray's own processes take most of
    # both cores for seconds, and this import (torch, transformers, DeepSpeed) would wait behind them.
    from training_core.train.launcher import check_before_launch, run_training

    train_dirs = [str(Path(p) / "train") for p in inputs.dataset_paths]
    # A config these refuse connects to no cluster and leaves no FAILED MLflow run behind.
    check_before_launch(config, model_path=inputs.base_model, train_dirs=train_dirs, seq_len=inputs.seq_len)
    if before_training is not None:
        before_training()
    name = ray_run_name(inputs, lineage, run_name_suffix)
    for abandoned in tracking.end_abandoned_runs(run_has_ended):
        log.warning("MLflow run %s was left RUNNING by a process that is gone: marked KILLED", abandoned)
    # Whoever serves the model must lay prompts out as it was trained (the window holds one format).
    prompt_format = read_prompt_format(inputs.dataset_paths[0])
    run_id = tracking.start_run(name, tags={"method": config.method, "prompt_format": prompt_format,
                                            **(extra_tags or {})})
    # Said first, so a step that fails (or is stopped) names the MLflow run that holds its lineage.
    log.info("MLflow run %s (experiment %s) started: training Ray run %s", run_id, tracking.experiment_id, name)
    try:
        tracking.log_lineage(run_id, lineage=lineage, config=config.model_dump(mode="json"),
                             dataset_paths=inputs.dataset_paths)
        result = run_training(
            config,
            model_path=inputs.base_model,
            train_dirs=train_dirs,
            seq_len=inputs.seq_len,
            cache_dir=inputs.cache_directory,
            cache_size_limit_bytes=inputs.cache_size_limit_bytes,
            cache_policy=inputs.cache_policy,
            # Content, not paths: the run name already holds these digests, and a base-model folder
            # moved with the same files (or a hub snapshot in another HF_HOME) must still resume.
            base_model_identity=f"base model {inputs.base_model_digest}",
            training_data_identity=[f"dataset {inputs.dataset_digest}"],
            storage_path=Path(ray_storage),
            run_name=name,
            output_dir=models_dir,
            recorded_code=CodeIdentity.from_lineage(lineage),  # the workers must run what the lineage records
            checked_before_launch=True,
        )
        tracking.log_training(run_id, result=result)
    except BaseException as error:
        # Best effort, and bounded: a tracking server that stopped answering leaves the run RUNNING
        # (warned), and this error, not one from ending the run, is what the step fails with.
        if (stopped_by := interruption(error)) is not None:  # stopped from outside: KILLED, not a crash
            if tracking.end_interrupted_run(run_id, stopped_by):
                log.warning("MLflow run %s ended KILLED: stopped by %s", run_id, stopped_by)
        elif tracking.end_failed_run(run_id, error):
            log.warning("MLflow run %s ended FAILED (%s)", run_id, type(error).__name__)
        raise
    tracking.end_run(run_id)
    return TrackedRun(mlflow_run_id=run_id, result=result, lineage=lineage)
