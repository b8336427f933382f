"""An MLflow run left RUNNING by a step process on another host (on Kubernetes every step pod has
its own hostname, so its process is never judged from here) is marked KILLED by the next training
once its Dagster run (the lineage's `dagster_run_id`) has ended; never while that run is still going,
unknown, or the one training now."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
from dagster._core.storage.dagster_run import DagsterRun

from assets.run_identity import ended_dagster_run_status
from training_core.tracking import ENDED_BY_TAG, PROCESS_TAG, MlflowTracking

POD_PROCESS = "tessera-run-abc-lora-adapter-xyz:7:123@bootid"  # an OOMKilled step pod's, as it tagged its run


def _pod_run(tracking: MlflowTracking, dagster_run_id: str | None) -> str:
    """A run as a step pod leaves it when killed: RUNNING, its lineage logged (or not yet, when None)."""
    run_id = tracking.client.create_run(tracking.experiment_id, run_name="train-x",
                                        tags={PROCESS_TAG: POD_PROCESS}).info.run_id
    if dagster_run_id is not None:
        tracking.log_batch(run_id, params={"dagster_run_id": dagster_run_id})
    return run_id


def _status(tracking: MlflowTracking, run_id: str) -> str:
    return tracking.client.get_run(run_id).info.status


def test_a_run_whose_dagster_run_ended_is_marked_killed_and_one_still_going_is_not(tmp_path: Path):
    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    failed = _pod_run(tracking, "dagster-failed")
    going = _pod_run(tracking, "dagster-going")
    before_lineage = _pod_run(tracking, None)
    ended = {"dagster-failed": "FAILURE"}

    assert tracking.end_abandoned_runs() == []  # without the Dagster side, another host's run is never judged
    assert tracking.end_abandoned_runs(ended.get) == [failed]
    assert {run_id: _status(tracking, run_id) for run_id in (failed, going, before_lineage)} == {
        failed: "KILLED", going: "RUNNING", before_lineage: "RUNNING"}
    assert tracking.client.get_run(failed).data.tags[ENDED_BY_TAG] == (
        "a later run: its Dagster run dagster-failed had ended (FAILURE)")


def test_the_dagster_side_names_ended_runs_only():
    with dg.instance_for_test() as instance:
        for run_id, status in {"failed": dg.DagsterRunStatus.FAILURE, "canceled": dg.DagsterRunStatus.CANCELED,
                               "going": dg.DagsterRunStatus.STARTED, "current": dg.DagsterRunStatus.SUCCESS}.items():
            instance.add_run(DagsterRun(job_name="train_and_promote", run_id=run_id, status=status))
        succeeded = dg.materialize([dg.asset(name="trained")(lambda: 1)], instance=instance).run_id

        run_has_ended = ended_dagster_run_status(instance, current_run_id="current")
        assert {run_id: run_has_ended(run_id) for run_id in
                ("failed", "canceled", succeeded, "going", "current", "unknown")} == {
            "failed": "FAILURE", "canceled": "CANCELED", succeeded: "SUCCESS",
            "going": None, "current": None, "unknown": None}


def test_the_next_training_ends_the_run_of_a_killed_step_pod(tmp_path: Path):
    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    with dg.instance_for_test() as instance:
        instance.add_run(DagsterRun(job_name="train_and_promote", run_id="pod-killed",
                                    status=dg.DagsterRunStatus.FAILURE))
        instance.add_run(DagsterRun(job_name="train_and_promote", run_id="training-now",
                                    status=dg.DagsterRunStatus.STARTED))
        killed = _pod_run(tracking, "pod-killed")
        running = _pod_run(tracking, "training-now")  # a step retry's earlier attempt: its run is still going

        assert tracking.end_abandoned_runs(ended_dagster_run_status(instance, "training-now")) == [killed]
    assert (_status(tracking, killed), _status(tracking, running)) == ("KILLED", "RUNNING")


def test_a_run_marked_killed_while_it_still_ran_drops_the_sweeps_tag_when_it_finishes(tmp_path: Path, caplog):
    """Dagster can end a run whose step pod still trains (run monitoring lost its heartbeat): the
    sweep marks its MLflow run KILLED, and the pod then ends it FINISHED itself. A FINISHED run
    saying something stopped it would send whoever reads it looking for a kill that did not happen."""
    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    still_training = _pod_run(tracking, "dagster-monitoring-failed")
    assert tracking.end_abandoned_runs({"dagster-monitoring-failed": "FAILURE"}.get) == [still_training]

    with caplog.at_level("WARNING", logger="training_core.tracking"):
        tracking.end_run(still_training)

    run = tracking.client.get_run(still_training)
    assert (run.info.status, ENDED_BY_TAG in run.data.tags) == ("FINISHED", False)
    assert f"MLflow run {still_training} was marked KILLED (by a later run" in caplog.text


def test_a_run_stopped_from_outside_keeps_the_tag_naming_what_stopped_it(tmp_path: Path):
    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    run_id = _pod_run(tracking, "dagster-terminated")
    tracking.end_interrupted_run(run_id, "SIGTERM")
    run = tracking.client.get_run(run_id)
    assert (run.info.status, run.data.tags[ENDED_BY_TAG]) == ("KILLED", "an interruption: SIGTERM")
