"""A training run that fails ends FAILED in MLflow with its reason in the `tessera.failure` tag:
``Type: message``, credentials redacted, cut to MLflow's tag limit; a store that cannot take the tag
does not hide the run's own error."""

from __future__ import annotations

import pytest
from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

import training_core.train.launcher as launcher
from training_core.errors import TrainingDivergedError
from training_core.runs import TrainingInputs, run_tracked_training
from training_core.tracking import FAILURE_TAG, MlflowTracking
from training_core.train.config import TrainingConfig


def _fail_in_training(monkeypatch, error: BaseException) -> None:
    """Training fails as a worker's error reaches the driver, after the MLflow run started."""
    def run_training(*args, **kwargs):
        raise error

    monkeypatch.setattr(launcher, "run_training", run_training)


def _tracking(tmp_path) -> MlflowTracking:
    return MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")


def _train(tracking: MlflowTracking, demo_model, demo_dataset, tmp_path) -> None:
    inputs = TrainingInputs(base_model=demo_model.name_or_path, base_model_digest=demo_model.digest,
                            dataset_paths=[demo_dataset.path], dataset_digest="window", seq_len=64,
                            cache_directory=None, cache_version="cache", partition_keys=["2026-11-01"])
    run_tracked_training(TrainingConfig(), inputs, tracking, ray_storage=str(tmp_path / "ray"),
                         models_dir=tmp_path / "models")


def _only_run(tracking: MlflowTracking):
    [run] = tracking.client.search_runs([tracking.experiment_id])
    return run


def test_a_failed_run_records_why_with_credentials_redacted(monkeypatch, demo_model, demo_dataset, tmp_path):
    message = "training loss became nan at step 7 (checkpoint http://alice:s3cret@store/run?sig=abc)"
    _fail_in_training(monkeypatch, TrainingDivergedError(message))
    tracking = _tracking(tmp_path)
    with pytest.raises(TrainingDivergedError, match="became nan at step 7"):
        _train(tracking, demo_model, demo_dataset, tmp_path)
    run = _only_run(tracking)
    assert run.info.status == "FAILED"
    reason = run.data.tags[FAILURE_TAG]
    assert reason == ("TrainingDivergedError: training loss became nan at step 7 "
                      "(checkpoint http://alice:***@store/run?sig=***)")
    assert tracking.client.search_runs([tracking.experiment_id], f"tags.`{FAILURE_TAG}` LIKE 'TrainingDiverged%'")


def test_a_long_reason_is_cut_to_the_tag_limit(monkeypatch, demo_model, demo_dataset, tmp_path):
    _fail_in_training(monkeypatch, RuntimeError("x" * (2 * MAX_TAG_VAL_LENGTH)))
    tracking = _tracking(tmp_path)
    with pytest.raises(RuntimeError):
        _train(tracking, demo_model, demo_dataset, tmp_path)
    reason = _only_run(tracking).data.tags[FAILURE_TAG]
    assert len(reason) == MAX_TAG_VAL_LENGTH and reason.startswith("RuntimeError: xxx") and reason.endswith("…")


def test_a_tag_the_store_refuses_does_not_hide_the_error(monkeypatch, demo_model, demo_dataset, tmp_path):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    def refuse_tag(self, run_id, key, value, *args, **kwargs):
        raise MlflowException("tag store unavailable")

    _fail_in_training(monkeypatch, TrainingDivergedError("training loss became inf at step 3"))
    tracking = _tracking(tmp_path)
    monkeypatch.setattr(MlflowClient, "set_tag", refuse_tag)
    with pytest.raises(TrainingDivergedError, match="became inf at step 3"):
        _train(tracking, demo_model, demo_dataset, tmp_path)
    run = _only_run(tracking)
    assert run.info.status == "FAILED" and FAILURE_TAG not in run.data.tags


def test_a_run_stopped_from_the_ui_ends_failed_with_why(monkeypatch, demo_model, demo_dataset, tmp_path):
    """Dagster's Terminate raises a BaseException in the step: the MLflow run must not stay RUNNING."""
    from dagster._core.errors import DagsterExecutionInterruptedError

    _fail_in_training(monkeypatch, DagsterExecutionInterruptedError())
    tracking = _tracking(tmp_path)
    with pytest.raises(DagsterExecutionInterruptedError):
        _train(tracking, demo_model, demo_dataset, tmp_path)
    run = _only_run(tracking)
    assert run.info.status == "FAILED" and run.data.tags[FAILURE_TAG] == "DagsterExecutionInterruptedError"
