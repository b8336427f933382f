"""`daily_retrain` never loses a day: each hourly tick starts the oldest closed day still to train whose
window is built, so a tick skipped while an earlier day's run was going (a catch-up after the daemon was
down, a run longer than a day) is made up by a later one. Ticks are evaluated on a real instance that
holds the runs the daemon would have launched and the materializations their success would leave."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import dagster as dg
import pytest
from dagster._utils.schedules import cron_string_iterator

from pipelines.definitions import defs

JOB = defs.resolve_job_def("train_and_promote")
SCHEDULE = defs.resolve_schedule_def("daily_retrain")
# How many missed ticks the daemon evaluates when it comes back (Dagster's default max_catchup_runs).
MAX_CATCHUP_TICKS = 5


@pytest.fixture(autouse=True)
def _embedded_defaults(monkeypatch):
    monkeypatch.delenv("TESSERA_RUN_CONFIG", raising=False)


@pytest.fixture
def instance():
    with dg.instance_for_test() as test_instance:
        yield test_instance


def _tick(instance: dg.DagsterInstance, day: int, hour: int = 2) -> dg.ScheduleExecutionData:
    """The tick scheduled at 2026-11-`day` `hour`:00 UTC, whenever it is evaluated."""
    with dg.build_schedule_context(instance=instance, repository_def=defs.get_repository_def(),
                                   scheduled_execution_time=datetime(2026, 11, day, hour, tzinfo=timezone.utc)
                                   ) as context:
        return SCHEDULE.evaluate_tick(context)


def _launch(instance: dg.DagsterInstance, result: dg.ScheduleExecutionData) -> dg.DagsterRun:
    """The run the daemon creates for the tick's one run request, before it submits it to the queue."""
    (request,) = result.run_requests
    return instance.create_run_for_job(JOB, run_config=request.run_config, status=dg.DagsterRunStatus.NOT_STARTED,
                                       tags={**request.tags, "dagster/partition": request.partition_key,
                                             "dagster/run_key": request.run_key})


def _trained(instance: dg.DagsterInstance, day: str) -> None:
    for asset in ("raw_examples", "training_dataset", "row_group_cache", "lora_adapter"):
        instance.report_runless_asset_event(dg.AssetMaterialization(asset, partition=day))


def _succeed(instance: dg.DagsterInstance, run: dg.DagsterRun) -> None:
    _trained(instance, run.tags["dagster/partition"])
    instance.report_dagster_event(dg.DagsterEvent(dg.DagsterEventType.RUN_SUCCESS.value, job_name=run.job_name),
                                  run_id=run.run_id)
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.SUCCESS


def _requested(result: dg.ScheduleExecutionData) -> list[str]:
    return [request.partition_key for request in result.run_requests or []]


def _at(day: int, hour: int, minute: int = 0) -> datetime:
    return datetime(2026, 11, day, hour, minute, tzinfo=timezone.utc)


def _daemon(instance: dg.DagsterInstance, start: datetime, end: datetime, training: timedelta,
            down_until: datetime | None = None) -> list[tuple[str, datetime]]:
    """Runs the daemon over the schedule's own ticks from `start` to `end`: (day, when) of each run it
    launches. Each run succeeds `training` after its launch. Down until `down_until`, it then evaluates
    the last MAX_CATCHUP_TICKS ticks it missed, one after the other, at that moment."""
    ticks = []
    for tick in cron_string_iterator(start.timestamp(), SCHEDULE.cron_schedule, SCHEDULE.execution_timezone):
        if tick >= end:
            break
        ticks.append(tick)
    missed = [tick for tick in ticks if down_until and tick < down_until][-MAX_CATCHUP_TICKS:]
    evaluations = [(tick, down_until) for tick in missed] + [
        (tick, tick) for tick in ticks if not (down_until and tick < down_until)]
    running, launched = [], []
    for scheduled, now in evaluations:
        for run, ends in list(running):
            if ends <= now:
                _succeed(instance, run)
                running.remove((run, ends))
        with dg.build_schedule_context(instance=instance, repository_def=defs.get_repository_def(),
                                       scheduled_execution_time=scheduled) as context:
            result = SCHEDULE.evaluate_tick(context)
        if result.run_requests:
            run = _launch(instance, result)
            running.append((run, now + training))
            launched.append((run.tags["dagster/partition"], now))
    return launched


def test_the_schedule_ticks_every_hour_from_two_utc():
    schedule = defs.resolve_schedule_def("daily_retrain")
    assert (schedule.cron_schedule, schedule.execution_timezone) == ("0 2-23 * * *", "UTC")


def test_a_catch_up_after_the_daemon_was_down_launches_every_day_in_order(instance):
    for day in ("2026-11-01", "2026-11-02", "2026-11-03", "2026-11-04"):
        _trained(instance, day)  # the schedule ran fine until the outage
    # Down over the 02:00 ticks of 11-06 and 11-07; back at 02:30, its catch-up launches 11-05 and finds
    # 11-06 waiting on it. A later tick starts 11-06 once 11-05 has succeeded, and so on, day by day.
    launched = _daemon(instance, _at(5, 23), _at(10, 3), training=timedelta(hours=5), down_until=_at(7, 2, 30))
    assert launched == [("2026-11-05", _at(7, 2, 30)), ("2026-11-06", _at(7, 8)), ("2026-11-07", _at(8, 2)),
                        ("2026-11-08", _at(9, 2)), ("2026-11-09", _at(10, 2))]


def test_the_catch_up_tick_that_finds_the_day_before_still_running_says_a_later_tick_starts_it(instance):
    for day in ("2026-11-01", "2026-11-02", "2026-11-03", "2026-11-04"):
        _trained(instance, day)
    run_1105 = _launch(instance, _tick(instance, 6))
    assert _tick(instance, 7).skip_message == (
        "not starting train_and_promote for 2026-11-06: its training window also reads 2026-11-05, whose "
        f"row_group_cache run is still queued or running (2026-11-05: run {run_1105.run_id}); a later tick starts "
        "train_and_promote for 2026-11-06 once it has succeeded")


def test_a_training_run_longer_than_a_day_delays_the_next_day_instead_of_dropping_it(instance):
    _trained(instance, "2026-11-01")
    launched = _daemon(instance, _at(3, 0), _at(6, 0), training=timedelta(hours=30))
    # Each day starts at the first tick after the run before it has succeeded.
    assert launched == [("2026-11-02", _at(3, 2)), ("2026-11-03", _at(4, 8)), ("2026-11-04", _at(5, 14))]


def test_hourly_ticks_after_the_days_run_was_launched_start_nothing_new(instance):
    _trained(instance, "2026-11-01")
    run = _launch(instance, _tick(instance, 3))
    assert run.tags["dagster/partition"] == "2026-11-02"
    for hour in range(3, 24):
        if hour == 12:
            _succeed(instance, run)
        assert _requested(_tick(instance, 3, hour)) == [], hour


def test_a_failed_day_is_not_relaunched_but_the_day_after_starts_once_its_window_is_built(instance):
    _trained(instance, "2026-11-01")
    instance.report_run_failed(_launch(instance, _tick(instance, 3)))  # 2026-11-02 failed before its cache
    assert _tick(instance, 3, 3).skip_message == (
        "nothing to start: each closed day from 2026-11-01 to 2026-11-02 has lora_adapter materialized or a run of "
        "train_and_promote (a day whose run failed is not retried: relaunch it by hand)")
    assert _tick(instance, 4).skip_message == (
        "not starting train_and_promote for 2026-11-03: its training window also reads 2026-11-02, where "
        "row_group_cache was never materialized, so lora_adapter would fail. Backfill assets "
        "base_model,raw_examples,training_dataset,row_group_cache for partition 2026-11-02; a later tick then "
        "starts train_and_promote for 2026-11-03")
    # The operator backfills 11-02's data a day later: the next tick starts 11-03, then 11-04 in turn.
    instance.report_runless_asset_event(dg.AssetMaterialization("row_group_cache", partition="2026-11-02"))
    run_1103 = _launch(instance, _tick(instance, 5))
    assert run_1103.tags["dagster/partition"] == "2026-11-03"
    _succeed(instance, run_1103)
    assert _requested(_tick(instance, 5, 3)) == ["2026-11-04"]


def test_the_oldest_ready_day_starts_while_an_older_one_waits_for_a_backfill(instance):
    for day in ("2026-11-01", "2026-11-02"):
        _trained(instance, day)
    instance.report_run_failed(instance.create_run_for_job(JOB, tags={"dagster/partition": "2026-11-03"}))
    # 11-04's data was backfilled (no training): 11-05 can train, 11-04 cannot until 11-03 is rebuilt.
    instance.report_runless_asset_event(dg.AssetMaterialization("row_group_cache", partition="2026-11-04"))
    run_1105 = _launch(instance, _tick(instance, 7))
    assert run_1105.tags["dagster/partition"] == "2026-11-05"
    # Nothing else is ready: the skip names what the oldest waiting day needs, then the days behind it.
    assert _tick(instance, 7, 3).skip_message == (
        "not starting train_and_promote for 2026-11-04: its training window also reads 2026-11-03, where "
        "row_group_cache was never materialized, so lora_adapter would fail. Backfill assets "
        "base_model,raw_examples,training_dataset,row_group_cache for partition 2026-11-03; a later tick then "
        "starts train_and_promote for 2026-11-04. Days after it wait their turn: 2026-11-06")
    _succeed(instance, run_1105)
    assert _requested(_tick(instance, 7, 4)) == ["2026-11-06"]


def test_a_day_is_considered_from_two_utc_the_day_after_by_the_ticks_own_time(instance):
    _trained(instance, "2026-11-01")
    # A tick scheduled before 02:00, evaluated whenever: the day that just closed may not have landed.
    assert _tick(instance, 3, 1).skip_message.startswith("nothing to start: each closed day from 2026-11-01 to "
                                                         "2026-11-01 ")
    assert _requested(_tick(instance, 3, 2)) == ["2026-11-02"]


def test_a_fresh_deployment_or_a_pause_longer_than_a_week_starts_from_the_day_that_just_closed(instance):
    assert _requested(_tick(instance, 2)) == ["2026-11-01"]  # the first partition: its window is that day alone
    # Nothing trained or tried: days before the last one may never be meant to train.
    assert _tick(instance, 8).skip_message.startswith(
        "not starting train_and_promote for 2026-11-07: its training window also reads 2026-11-06, where "
        "row_group_cache was never materialized")
    _trained(instance, "2026-11-01")
    assert _requested(_tick(instance, 8)) == ["2026-11-02"]  # closed: 11-01 to 11-07, caught up from 11-02
    # A pause past CATCH_UP_DAYS: 11-01 is no longer among them, and a day a week old is left to the operator.
    assert _tick(instance, 10).skip_message.startswith(
        "not starting train_and_promote for 2026-11-09: its training window also reads 2026-11-08, where")


def test_a_day_whose_own_data_is_being_backfilled_waits_for_that_run(instance):
    _trained(instance, "2026-11-01")
    backfill = instance.create_run_for_job(defs.resolve_implicit_global_asset_job_def(),
                                           status=dg.DagsterRunStatus.STARTED,
                                           tags={"dagster/partition": "2026-11-02"})
    assert _tick(instance, 3).skip_message == (
        f"not starting train_and_promote for 2026-11-02: run {backfill.run_id} of that day is still queued or "
        "running; a later tick reconsiders 2026-11-02 once it has ended")
    instance.report_dagster_event(dg.DagsterEvent(dg.DagsterEventType.RUN_SUCCESS.value, job_name=backfill.job_name),
                                  run_id=backfill.run_id)
    assert _requested(_tick(instance, 3, 3)) == ["2026-11-02"]
