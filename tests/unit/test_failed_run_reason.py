"""A training run that fails ends FAILED in MLflow with its reason in the `tessera.failure` tag:
``Type: message``, credentials redacted, cut to MLflow's tag limit; a store that cannot take the tag
does not hide the run's own error. A run stopped from outside (Ctrl-C, SIGTERM, Dagster's Terminate)
ends KILLED instead, its `tessera.ended_by` tag naming what stopped it, and `tessera reproduce`
refuses it. The step's log names the MLflow run as it starts and as it ends."""

from __future__ import annotations

import logging

import pytest
from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

import training_core.train.launcher as launcher
from training_core.errors import LineageError, TrainingDivergedError
from training_core.reproduce import load_recorded_run
from training_core.runs import TrainingInputs, run_tracked_training
from training_core.tracking import ENDED_BY_TAG, FAILURE_TAG, MlflowTracking
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


def test_a_diverged_run_shows_its_losses_up_to_the_failure(monkeypatch, demo_model, demo_dataset, tmp_path):
    # Where one looks for why a run diverged: its curve, as far as it was finite.
    curve = [(1, 3.4), (2, 3.1), (3, 2.9)]
    _fail_in_training(monkeypatch, TrainingDivergedError("training diverged: nan at step 4", loss_history=curve))
    tracking = _tracking(tmp_path)
    with pytest.raises(TrainingDivergedError):
        _train(tracking, demo_model, demo_dataset, tmp_path)
    run = _only_run(tracking)
    assert run.info.status == "FAILED"
    assert tracking.loss_history(run.info.run_id) == curve


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


def _dagster_terminate() -> BaseException:
    from dagster._core.errors import DagsterExecutionInterruptedError

    return DagsterExecutionInterruptedError()


@pytest.mark.parametrize(("stop", "ended_by"), [
    (_dagster_terminate, "an interruption: Dagster's Terminate (DagsterExecutionInterruptedError)"),
    (KeyboardInterrupt, "an interruption: Ctrl-C (KeyboardInterrupt)"),
    # Ctrl-C or SIGTERM while the driver waits in ray.get reaches it as SystemExit(1)
    (lambda: SystemExit(1), "an interruption: a signal to stop, such as Ctrl-C or SIGTERM (SystemExit: 1)"),
], ids=["dagster terminate", "ctrl-c", "signal in ray.get"])
def test_a_run_stopped_from_outside_ends_killed_saying_what_stopped_it(monkeypatch, demo_model, demo_dataset,
                                                                      tmp_path, caplog, stop, ended_by):
    """Not FAILED with `SystemExit: 1`: an operator must tell a stop from a crash. The run must not
    stay RUNNING either, and a reproduction of it is refused (it has no results)."""
    error = stop()
    _fail_in_training(monkeypatch, error)
    tracking = _tracking(tmp_path)
    with caplog.at_level(logging.INFO, logger="training_core.runs"), pytest.raises(type(error)):
        _train(tracking, demo_model, demo_dataset, tmp_path)
    run = _only_run(tracking)
    assert run.info.status == "KILLED" and FAILURE_TAG not in run.data.tags
    assert run.data.tags[ENDED_BY_TAG] == ended_by
    assert f"MLflow run {run.info.run_id} ended KILLED: stopped by {ended_by.removeprefix('an interruption: ')}" \
        in caplog.messages
    # A later training's sweep of abandoned runs leaves it as it is: only RUNNING runs are its business.
    assert tracking.end_abandoned_runs() == []
    with pytest.raises(LineageError, match=f"MLflow run {run.info.run_id} ended KILLED: it did not finish"):
        load_recorded_run(tracking, run.info.run_id, cache_directory=None)


def test_the_step_log_names_the_mlflow_run_as_it_starts_and_fails(monkeypatch, demo_model, demo_dataset, tmp_path,
                                                                  caplog):
    """A failed lora_adapter step's log is where an operator starts: it must name the MLflow run."""
    _fail_in_training(monkeypatch, TrainingDivergedError("training loss became nan at step 7"))
    tracking = _tracking(tmp_path)
    with caplog.at_level(logging.INFO, logger="training_core.runs"), pytest.raises(TrainingDivergedError):
        _train(tracking, demo_model, demo_dataset, tmp_path)
    run = _only_run(tracking)
    assert f"MLflow run {run.info.run_id} (experiment {tracking.experiment_id}) started: training Ray run " \
           f"{run.info.run_name}" in caplog.messages
    assert f"MLflow run {run.info.run_id} ended FAILED (TrainingDivergedError)" in caplog.messages
