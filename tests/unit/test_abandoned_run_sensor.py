"""`free_abandoned_runs`: under `dagster dev` the code server fails only the runs it launched itself whose
process died. A run of a killed `tessera demo`, or of any launcher when the machine restarted, stayed STARTED
for ever: it held the training pool slot, and `daily_retrain` waited behind it ("once it has ended")."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timezone

import dagster as dg
from dagster._core.storage.dagster_run import DagsterRun

from pipelines.definitions import defs
from pipelines.instance import LAUNCHER_TAG
from training_core.process_identity import this_process

SENSOR = defs.resolve_sensor_def("free_abandoned_runs")
SCHEDULE = defs.resolve_schedule_def("daily_retrain")


def _identity_of_a_finished_process() -> str:
    """The launcher tag a process writes, of a process that has exited since."""
    code = "from training_core.process_identity import this_process; print(this_process())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def _tick(instance: dg.DagsterInstance, day: int) -> dg.ScheduleExecutionData:
    with dg.build_schedule_context(instance=instance, repository_def=defs.get_repository_def(),
                                   scheduled_execution_time=datetime(2026, 11, day, 2, tzinfo=timezone.utc)) as context:
        return SCHEDULE.evaluate_tick(context)


def test_the_sensor_fails_a_killed_launchers_run_and_the_schedule_then_starts_the_next_day(monkeypatch):
    monkeypatch.delenv("TESSERA_RUN_CONFIG", raising=False)
    with dg.instance_for_test() as instance:
        for day in ("2026-11-01", "2026-11-02"):
            for asset in ("raw_examples", "training_dataset", "row_group_cache"):
                instance.report_runless_asset_event(dg.AssetMaterialization(asset, partition=day))
        instance.report_runless_asset_event(dg.AssetMaterialization("lora_adapter", partition="2026-11-01"))
        killed = instance.add_run(DagsterRun(
            job_name="train_and_promote", run_id="killed-mid-training", status=dg.DagsterRunStatus.STARTED,
            tags={"dagster/partition": "2026-11-02", LAUNCHER_TAG: _identity_of_a_finished_process()}))
        training = instance.add_run(DagsterRun(
            job_name="train_and_promote", run_id="training-now", status=dg.DagsterRunStatus.STARTED,
            tags={"dagster/partition": "2026-10-31", LAUNCHER_TAG: this_process()}))
        assert _tick(instance, 4).skip_message.startswith(
            "not starting train_and_promote for 2026-11-03: its training window also reads 2026-11-02")

        with dg.build_sensor_context(instance=instance, repository_def=defs.get_repository_def()) as context:
            result = SENSOR.evaluate_tick(context)

        assert result.skip_message == f"marked failed, their process being gone: {killed.run_id}"
        assert instance.get_run_by_id(killed.run_id).status == dg.DagsterRunStatus.FAILURE
        assert instance.get_run_by_id(training.run_id).status == dg.DagsterRunStatus.STARTED
        assert [request.partition_key for request in _tick(instance, 4).run_requests] == ["2026-11-03"]


def test_the_sensor_runs_by_default_in_the_local_code_location_only():
    from pipelines.definitions_kubernetes import defs as kubernetes_defs

    assert SENSOR.default_status == dg.DefaultSensorStatus.RUNNING
    assert SENSOR.minimum_interval_seconds == 60
    # On Kubernetes every run is a pod on another host: Dagster's run monitoring judges those.
    assert not list(kubernetes_defs.sensors or [])


def test_a_run_that_ended_by_itself_as_its_process_exited_keeps_its_own_status(monkeypatch):
    """The sweep lists STARTED runs, then asks whether each launcher is gone: a run whose last event was
    its own success just before its process exited in between was recorded FAILURE after SUCCESS."""
    import training_core.process_identity as process_identity
    from pipelines.instance import fail_abandoned_runs

    with dg.instance_for_test() as instance:
        run = instance.add_run(DagsterRun(job_name="train_and_promote", run_id="succeeding",
                                          status=dg.DagsterRunStatus.STARTED,
                                          tags={LAUNCHER_TAG: _identity_of_a_finished_process()}))
        judge = process_identity.process_is_gone

        def succeeds_then_exits(launcher: str) -> bool:
            instance.report_dagster_event(dg.DagsterEvent(dg.DagsterEventType.RUN_SUCCESS.value,
                                                          job_name=run.job_name), run_id=run.run_id)
            return judge(launcher)

        monkeypatch.setattr(process_identity, "process_is_gone", succeeds_then_exits)
        assert fail_abandoned_runs(instance) == []
        assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.SUCCESS


def test_the_sensor_frees_the_slot_and_queue_places_that_ended_runs_still_hold():
    """The code server marks a run it launched whose process was killed FAILURE but frees none of its pool
    slots, and a run canceled while it waited keeps its place in the queue, to which a freed slot is
    handed next: either way the training pool stayed taken and every later training waited for ever."""
    with dg.instance_for_test() as instance:
        storage = instance.event_log_storage
        storage.set_concurrency_slots("training", 1)
        for run_id in ("killed-by-oom", "canceled-while-waiting", "waiting-now"):
            instance.add_run(DagsterRun(job_name="train_and_promote", run_id=run_id,
                                        status=dg.DagsterRunStatus.STARTED))
            storage.claim_concurrency_slot("training", run_id, "lora_adapter")
        instance.report_run_failed(instance.get_run_by_id("killed-by-oom"), "run worker terminated by signal 9")
        instance.report_run_canceled(instance.get_run_by_id("canceled-while-waiting"))
        assert not storage.claim_concurrency_slot("training", "waiting-now", "lora_adapter").is_claimed

        with dg.build_sensor_context(instance=instance, repository_def=defs.get_repository_def()) as context:
            result = SENSOR.evaluate_tick(context)

        assert result.skip_message == ("freed the pool slots that ended runs still held: "
                                       "canceled-while-waiting, killed-by-oom")
        assert storage.claim_concurrency_slot("training", "waiting-now", "lora_adapter").is_claimed
        with dg.build_sensor_context(instance=instance, repository_def=defs.get_repository_def()) as context:
            assert SENSOR.evaluate_tick(context).skip_message == (
                "no run abandoned by a killed process, no slot held by an ended run")


def test_one_sweep_fails_runs_whose_process_is_gone_and_frees_what_ended_runs_hold():
    """What every launcher (`tessera demo`, its watch while it waits, `tessera free-slots`) and the sensor run:
    a run marked failed for its gone process is reported once, as failed, not again as an ended run."""
    from pipelines.instance import free_training_pool

    with dg.instance_for_test() as instance:
        storage = instance.event_log_storage
        storage.set_concurrency_slots("training", 2)
        runs = {"launcher-killed": {LAUNCHER_TAG: _identity_of_a_finished_process()}, "ended-holding": {},
                "waiting-now": {}}
        for run_id, tags in runs.items():
            instance.add_run(DagsterRun(job_name="train_and_promote", run_id=run_id,
                                        status=dg.DagsterRunStatus.STARTED, tags=tags))
            storage.claim_concurrency_slot("training", run_id, "lora_adapter")
        instance.report_run_failed(instance.get_run_by_id("ended-holding"), "run worker terminated by signal 9")

        assert free_training_pool(instance) == (["launcher-killed"], ["ended-holding"])
        assert instance.get_run_by_id("launcher-killed").status == dg.DagsterRunStatus.FAILURE
        assert storage.get_concurrency_run_ids() == {"waiting-now"}
        assert free_training_pool(instance) == ([], [])
