"""Rebuild a training run's exact inputs from its MLflow lineage, check them, and compare results."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from training_core.data import cache_version
from training_core.data.batch_columns import TRAINING_COLUMNS
from training_core.data.batch_columns import TRAINING_TRANSFORM_VERSION as TRANSFORM_VERSION
from training_core.data.window import window_digest
from training_core.base_model import HubRevision, base_model_changes, hub_branch_commit, pinned_snapshot
from training_core.errors import ConfigError, LineageError
from training_core.evaluate.settings import EvalSettings
from training_core.lineage import code_version, installed_version, parse_dataset_paths, parse_partition_keys
from training_core.redaction import redact_uri
from training_core.runs import TrainingInputs
from training_core.storage import changed_files, directory_digest
from training_core.tracking import MlflowTracking, restore_credentials_hint
from training_core.train.config import TrainingConfig, config_values_digest, dotted_settings, parse_training_config

CONFIG_ARTIFACT = "training_config.json"
LINEAGE_PARAMS = (
    "dataset_paths", "dataset_digest", "base_model", "base_model_digest", "cache_version", "config_digest",
)


@dataclass(frozen=True)
class RecordedRun:
    run_id: str
    config: TrainingConfig
    inputs: TrainingInputs
    params: dict[str, str]
    eval_settings: EvalSettings  # what its eval metrics were produced with (defaults if never evaluated)
    # (config.<field>, "not recorded", its default now): fields this code added since the run, filled
    # from their defaults; a reason results may differ, printed with the version drift
    config_drift: list[tuple[str, str, str]]


def load_recorded_run(tracking: MlflowTracking, run_id: str, cache_directory: str | None,
                      base_digest_records: Path | None = None) -> RecordedRun:
    """Read the lineage record and verify every input still exists with the recorded digest
    (``base_digest_records``: where per-file digests of users' base-model folders are kept)."""
    run = _finished_run(tracking, run_id)
    params = run.data.params
    missing = [k for k in LINEAGE_PARAMS if k not in params]
    if missing:
        raise LineageError(f"run {run_id} lacks lineage params {missing}; it was not recorded by Tessera")
    recorded_values = _recorded_config_values(tracking, run_id)
    config = _parsed_config(run_id, recorded_values)
    # Over the JSON as recorded (TrainingConfig.digest of the config then): re-parsed, the fields added
    # since are filled in and every older run's digest would differ.
    if config_values_digest(recorded_values) != params["config_digest"]:
        raise LineageError(f"run {run_id}: {CONFIG_ARTIFACT} does not match its recorded config_digest")
    config_drift = [(f"config.{name}", "not recorded", f"{value!r} (default)")
                    for name, value in _fields_not_in(config.model_dump(mode="json"), recorded_values)]

    datasets = [Path(p) for p in _recorded_dataset_paths(run_id, params["dataset_paths"])]
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
    hub = HubRevision.from_digest(params["base_model_digest"])
    if hub is not None:
        base = _pinned_hub_snapshot(run_id, hub, base)
    else:
        if not base.is_dir():
            raise LineageError(f"run {run_id}: base model {base} is gone")
        if changes := base_model_changes(base, params["base_model_digest"], base_digest_records):
            named = [f"{base / change}" for change in changes if not change.startswith("contents (")]
            raise LineageError(f"run {run_id}: base model {base} no longer matches its recorded digest"
                               + (f": {', '.join(named)}" if named else ""))
    inputs = TrainingInputs(
        base_model=str(base),
        base_model_digest=params["base_model_digest"],
        dataset_paths=[str(d) for d in datasets],
        dataset_digest=params["dataset_digest"],
        seq_len=_seq_len(run_id, datasets[0]),
        cache_directory=cache_directory,
        cache_version=params["cache_version"],
        partition_keys=parse_partition_keys(params.get("partition_keys", "")),
    )
    try:
        eval_settings = EvalSettings.from_tags(run.data.tags)
    except ConfigError as error:
        raise LineageError(f"run {run_id}: its evaluation settings cannot be read back: {error}") from None
    return RecordedRun(run_id, config, inputs, params, eval_settings, config_drift)


def _fields_not_in(parsed: dict, recorded: dict) -> list[tuple[str, object]]:
    """(dotted name, value) of the fields in ``parsed`` that ``recorded`` lacks, nested ones too
    (a field added to the LoRA settings is ``lora.<name>``), sorted by name."""
    recorded_names = dotted_settings(recorded).keys()
    return sorted((name, value) for name, value in dotted_settings(parsed).items() if name not in recorded_names)


def _pinned_hub_snapshot(run_id: str, hub: HubRevision, recorded_folder: Path) -> Path:
    """`base_model.pinned_snapshot`, refusing a run recorded without its commit and naming the run."""
    if hub.commit is None:
        raise LineageError(
            f"run {run_id}: its base model {hub.repo_id} is a hub model recorded without its revision (by a "
            f"Tessera that did not pin hub revisions; {_now_at(hub.repo_id)}), so which weights it trained on is "
            "unknown; rematerialize base_model, training_dataset and lora_adapter for a run that can be reproduced")
    try:
        return pinned_snapshot(hub, recorded_folder)
    except (OSError, ValueError) as error:
        raise LineageError(
            f"run {run_id}: base model {hub.repo_id} at its recorded revision {hub.commit} cannot be had "
            f"({_now_at(hub.repo_id)}): {error}") from error


def _now_at(repo_id: str) -> str:
    commit = hub_branch_commit(repo_id)
    return f"its main branch is at {commit} now" if commit else "its current revision is unknown here"


def lineage_drift(params: dict[str, str]) -> list[tuple[str, str, str]]:
    """(param, recorded, now) for the code version and each recorded `version_<package>` that
    differ from this environment: a reason results may differ, not a reason to refuse."""
    current = {key: installed_version(key.removeprefix("version_")) for key in params if key.startswith("version_")}
    if "code_version" in params:
        current["code_version"] = code_version()
    return [(key, params[key], now) for key, now in sorted(current.items()) if params[key] != now]


def _finished_run(tracking: MlflowTracking, run_id: str):
    """The MLflow run, refused unless it FINISHED: only a finished run has lineage and results."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, RESOURCE_DOES_NOT_EXIST, ErrorCode

    try:
        run = tracking.client.get_run(run_id)
    except MlflowException as error:
        if error.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            raise LineageError(f"MLflow run {run_id} not found at {redact_uri(tracking.tracking_uri)}") from error
        if error.error_code == ErrorCode.Name(INVALID_PARAMETER_VALUE):
            raise LineageError(f"{run_id!r} is not an MLflow run id (a 32-character hex id, "
                               f"as shown in the MLflow UI)") from error
        raise _unreadable_store(tracking, run_id, error.message) from error
    except Exception as error:  # a store MLflow does not wrap (network, driver): still not "not found"
        raise _unreadable_store(tracking, run_id, str(error)) from error
    if run.info.lifecycle_stage == "deleted":  # in the trash: `mlflow gc` may purge it and its artifacts any time
        raise LineageError(
            f"MLflow run {run_id} is deleted; restore it first with "
            f"`MLFLOW_TRACKING_URI={redact_uri(tracking.tracking_uri)} mlflow runs restore --run-id {run_id}`"
            f"{restore_credentials_hint(tracking.tracking_uri)}")
    status = run.info.status
    if status in ("RUNNING", "SCHEDULED"):
        raise LineageError(
            f"MLflow run {run_id} is still running ({status}); wait for it or, if its process died, "
            f"rematerialize lora_adapter (training resumes from its checkpoints in a new MLflow run) "
            f"and reproduce that run")
    if status != "FINISHED":
        raise LineageError(f"MLflow run {run_id} ended {status}: it did not finish, so it has no results "
                           f"to compare against; reproduce a FINISHED run")
    return run


def _unreadable_store(tracking: MlflowTracking, run_id: str, reason: str) -> LineageError:
    return LineageError(f"cannot read MLflow run {run_id} from the tracking store at "
                        f"{redact_uri(tracking.tracking_uri)}: {redact_uri(reason)} (is the store locked by another "
                        "process or damaged?)")


def _recorded_config_values(tracking: MlflowTracking, run_id: str) -> dict:
    """The run's resolved config artifact as recorded: a JSON object."""
    from mlflow.exceptions import MlflowException

    # Our own folder, removed on exit: without dst_path MLflow downloads into a temp folder it keeps.
    with tempfile.TemporaryDirectory(prefix="tessera-reproduce-") as folder:
        try:
            text = Path(tracking.client.download_artifacts(run_id, CONFIG_ARTIFACT, folder)).read_bytes()
        except (MlflowException, OSError) as error:
            raise LineageError(f"run {run_id}: cannot read its artifact {CONFIG_ARTIFACT} from "
                               f"{redact_uri(tracking.tracking_uri)}: {redact_uri(str(error))}") from error
    try:
        values = json.loads(text)
    except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
        raise LineageError(f"run {run_id}: artifact {CONFIG_ARTIFACT} is not valid JSON: {error}") from error
    if not isinstance(values, dict):
        raise LineageError(f"run {run_id}: artifact {CONFIG_ARTIFACT} holds a JSON {type(values).__name__}, "
                           f"not a config object")
    return values


def _parsed_config(run_id: str, values: dict) -> TrainingConfig:
    try:
        return parse_training_config(values)
    except (ConfigError, ValidationError) as error:
        raise LineageError(f"run {run_id}: artifact {CONFIG_ARTIFACT} is not a valid training config "
                           f"for this code: {error}") from error


def _recorded_dataset_paths(run_id: str, value: str) -> list[str]:
    try:
        paths = parse_dataset_paths(value)
    except ValueError as error:
        raise LineageError(f"run {run_id}: param dataset_paths is not a list of paths: {error}") from error
    if not paths or not all(path.strip() for path in paths):
        raise LineageError(f"run {run_id}: param dataset_paths {value!r} names no dataset (or a blank one)")
    return paths


def _seq_len(run_id: str, dataset: Path) -> int:
    manifest = dataset / "manifest.json"
    try:
        return int(json.loads(manifest.read_text())["spec"]["seq_len"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise LineageError(f"run {run_id}: cannot read spec.seq_len from {manifest}: {error!r}") from error


def compare_runs(tracking: MlflowTracking, original_id: str,
                 reproduced_id: str) -> list[tuple[str, float | str | None, float | str | None, bool | None]]:
    """(metric, original, reproduced, equal) for the loss curve and every final metric either run has;
    equal is None for a metric the original run never recorded. The curve's row shows its length in
    steps, or, where the curves differ, the first step that does and both losses there."""
    client = tracking.client
    original_curve, reproduced_curve = tracking.loss_history(original_id), tracking.loss_history(reproduced_id)
    rows: list[tuple[str, float | str | None, float | str | None, bool | None]] = [
        ("train_loss curve", *_curve_cells(original_curve, reproduced_curve), original_curve == reproduced_curve)]
    original = client.get_run(original_id).data.metrics
    reproduced = client.get_run(reproduced_id).data.metrics
    comparable = ("train_loss", "eval_loss", "eval_exact_match", "eval_perplexity", "steps")
    for name in comparable:
        if name in original or name in reproduced:
            a, b = original.get(name), reproduced.get(name)
            # None: the original never recorded it (e.g. its evaluation step did not run), nothing to compare
            rows.append((name, a, b, None if a is None else a == b))
    return rows


def _curve_cells(original: list[tuple[int, float]], reproduced: list[tuple[int, float]]) -> tuple[str, str]:
    for (original_step, original_loss), (reproduced_step, reproduced_loss) in zip(original, reproduced):
        if (original_step, original_loss) != (reproduced_step, reproduced_loss):
            return f"step {original_step}: {original_loss!r}", f"step {reproduced_step}: {reproduced_loss!r}"
    return f"{len(original)} steps", f"{len(reproduced)} steps"


def _which_files(directories: list[Path]) -> str:
    """": a/b.parquet (changed), …" from the digests recorded at publication, where there are any."""
    found = [f"{directory / name}" for directory in directories for name in (changed_files(directory) or [])]
    return f": {', '.join(found)}" if found else ""
