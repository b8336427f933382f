"""Rebuild a training run's exact inputs from its MLflow lineage, check them, and compare results."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from training_core.data import cache_version
from training_core.data.batch_columns import TRAINING_COLUMNS
from training_core.data.window import window_digest
from training_core.errors import LineageError
from training_core.runs import TrainingInputs
from training_core.storage import changed_files, directory_digest
from training_core.tracking import MlflowTracking
from training_core.train.config import TrainingConfig, parse_training_config

TRANSFORM_VERSION = "none"  # the training reader applies no transform


@dataclass(frozen=True)
class RecordedRun:
    run_id: str
    config: TrainingConfig
    inputs: TrainingInputs
    params: dict[str, str]


def load_recorded_run(tracking: MlflowTracking, run_id: str, cache_directory: str | None) -> RecordedRun:
    """Read the lineage record and verify every input still exists with the recorded digest."""
    client = tracking.client
    try:
        run = client.get_run(run_id)
    except Exception as error:  # MlflowException: RESOURCE_DOES_NOT_EXIST
        raise LineageError(f"MLflow run {run_id} not found at {tracking.tracking_uri}") from error
    params = run.data.params
    missing = [k for k in ("dataset_paths", "dataset_digest", "base_model", "base_model_digest", "cache_version") if k not in params]
    if missing:
        raise LineageError(f"run {run_id} lacks lineage params {missing}; it was not recorded by Tessera")
    config = parse_training_config(json.loads(Path(client.download_artifacts(run_id, "training_config.json")).read_text()))
    if config.digest() != params.get("config_digest"):
        raise LineageError(f"run {run_id}: training_config.json does not match its recorded config_digest")

    datasets = [Path(p) for p in params["dataset_paths"].split(",")]
    digests = []
    for dataset in datasets:
        if not dataset.is_dir():
            raise LineageError(f"run {run_id}: dataset {dataset} is gone; rematerialize training_dataset for "
                               f"partition(s) {params.get('partition_keys')}")
        digests.append(directory_digest(dataset))
    if window_digest(digests) != params["dataset_digest"]:
        changed = [d for d, digest in zip(datasets, digests) if not d.name.startswith(digest[:16])] or datasets
        raise LineageError(f"run {run_id}: dataset {', '.join(map(str, changed))} no longer matches the "
                           f"recorded digest {params['dataset_digest'][:16]}; its content changed"
                           + _which_files(changed))
    rebuilt_cache = window_digest([cache_version(d, TRAINING_COLUMNS, TRANSFORM_VERSION) for d in digests])
    if rebuilt_cache != params["cache_version"]:
        raise LineageError(f"run {run_id}: cache version {params['cache_version']} cannot be rebuilt by this code")
    base = Path(params["base_model"])
    if not params["base_model_digest"].startswith("hub:"):
        if not base.is_dir():
            raise LineageError(f"run {run_id}: base model {base} is gone")
        if directory_digest(base) != params["base_model_digest"]:
            raise LineageError(f"run {run_id}: base model {base} no longer matches its recorded digest"
                               + _which_files([base]))
    manifest = json.loads((datasets[0] / "manifest.json").read_text())
    inputs = TrainingInputs(
        base_model=params["base_model"],
        base_model_digest=params["base_model_digest"],
        dataset_paths=[str(d) for d in datasets],
        dataset_digest=params["dataset_digest"],
        seq_len=int(manifest["spec"]["seq_len"]),
        cache_directory=cache_directory,
        cache_version=params["cache_version"],
        partition_keys=[k for k in params.get("partition_keys", "").split(",") if k],
    )
    return RecordedRun(run_id, config, inputs, params)


def compare_runs(tracking: MlflowTracking, original_id: str, reproduced_id: str) -> list[tuple[str, float | None, float | None, bool]]:
    """(metric, original, reproduced, equal) for the loss curve and every final metric both runs have."""
    client = tracking.client

    def curve(run_id: str) -> list[float]:
        return [loss for _, loss in tracking.loss_history(run_id)]

    rows = []
    original_curve, reproduced_curve = curve(original_id), curve(reproduced_id)
    rows.append(("train_loss curve (steps)", float(len(original_curve)), float(len(reproduced_curve)),
                 original_curve == reproduced_curve))
    original = client.get_run(original_id).data.metrics
    reproduced = client.get_run(reproduced_id).data.metrics
    comparable = ("train_loss", "eval_loss", "eval_exact_match", "eval_perplexity", "steps")
    for name in comparable:
        if name in original or name in reproduced:
            a, b = original.get(name), reproduced.get(name)
            rows.append((name, a, b, a == b))
    return rows


def _which_files(directories: list[Path]) -> str:
    """": a/b.parquet (changed), …" from the digests recorded at publication, where there are any."""
    found = [f"{directory / name}" for directory in directories for name in (changed_files(directory) or [])]
    return f": {', '.join(found)}" if found else ""
