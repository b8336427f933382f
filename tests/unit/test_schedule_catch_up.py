"""`daily_retrain` never loses a day: each hourly tick starts the oldest closed day still to train whose
window is built, so a tick skipped while an earlier day's run was going (a catch-up after the daemon was
down, a run longer than a day) is made up by a later one. Ticks are evaluated on a real instance that
holds the runs the daemon would have launched and the materializations their success would leave."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import dagster as dg
import pytest
from dagster._core.execution.backfill import BulkActionStatus, PartitionBackfill
from dagster._utils.schedules import cron_string_iterator

from pipelines.definitions import defs

JOB = defs.resolve_job_def("train_and_promote")
SCHEDULE = defs.resolve_schedule_def("daily_retrain")
# How many missed ticks the daemon evaluates when it comes back: a schedule without a partition set
# ("not trying to catch up", says its log) gets the latest one only.
MAX_CATCHUP_TICKS = 1


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
    launches. Each run materializes its day's assets and succeeds `training` after its launch (a real run
    builds row_group_cache earlier, before its training: the next day can start from then). Down until
    `down_until`, it then evaluates the last MAX_CATCHUP_TICKS ticks it missed, one after the other, at
    that moment."""
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
    # Down over the 02:00 ticks of 11-06 and 11-07; back at 02:30, the one missed tick it evaluates launches
    # 11-05 and finds 11-06 waiting on it. A later tick starts 11-06 once 11-05's run has ended, and so on.
    launched = _daemon(instance, _at(5, 23), _at(10, 3), training=timedelta(hours=5), down_until=_at(7, 2, 30))
    assert launched == [("2026-11-05", _at(7, 2, 30)), ("2026-11-06", _at(7, 8)), ("2026-11-07", _at(8, 2)),
                        ("2026-11-08", _at(9, 2)), ("2026-11-09", _at(10, 2))]


def test_the_catch_up_tick_that_finds_the_day_before_still_running_says_a_later_tick_starts_it(instance):
    for day in ("2026-11-01", "2026-11-02", "2026-11-03", "2026-11-04"):
        _trained(instance, day)
    run_1105 = _launch(instance, _tick(instance, 6))
    assert _tick(instance, 7).skip_message == (
        "not starting train_and_promote for 2026-11-06: its training window also reads 2026-11-05, whose run or "
        f"backfill is still going (2026-11-05: run {run_1105.run_id} queued or running); a later tick "
        "starts train_and_promote for 2026-11-06 once it has ended")


def test_the_next_day_waits_for_the_day_befores_run_to_end_even_once_its_cache_is_built(instance):
    # Two trainings at once would each hold the workers where no pool limit serialises them (Kubernetes).
    _trained(instance, "2026-11-01")
    run_1102 = _launch(instance, _tick(instance, 3))
    instance.report_dagster_event(dg.DagsterEvent(dg.DagsterEventType.RUN_START.value, job_name=run_1102.job_name),
                                  run_id=run_1102.run_id)
    for asset in ("raw_examples", "training_dataset", "row_group_cache"):  # its data steps done, training goes on
        instance.report_runless_asset_event(dg.AssetMaterialization(asset, partition="2026-11-02"))
    assert instance.get_run_by_id(run_1102.run_id).status == dg.DagsterRunStatus.STARTED
    assert _tick(instance, 4).skip_message.endswith("a later tick starts train_and_promote for 2026-11-03 once it "
                                                    "has ended")
    _succeed(instance, run_1102)
    assert _requested(_tick(instance, 4, 3)) == ["2026-11-03"]


def test_a_training_run_longer_than_a_day_delays_the_next_day_instead_of_dropping_it(instance):
    _trained(instance, "2026-11-01")
    launched = _daemon(instance, _at(3, 0), _at(6, 0), training=timedelta(hours=30))
    # Each day starts at the first tick after the run before it has built its data (here: when it succeeds).
    assert launched == [("2026-11-02", _at(3, 2)), ("2026-11-03", _at(4, 8)), ("2026-11-04", _at(5, 14))]


def test_hourly_ticks_after_the_days_run_was_launched_start_nothing_new(instance):
    _trained(instance, "2026-11-01")
    run = _launch(instance, _tick(instance, 3))
    assert run.tags["dagster/partition"] == "2026-11-02"
    for hour in range(3, 24):
        if hour == 12:
            _succeed(instance, run)
        assert _requested(_tick(instance, 3, hour)) == [], hour
        if hour == 3:  # not "relaunch it by hand": the day is training
            assert _tick(instance, 3, hour).skip_message == (
                f"nothing new to start: run {run.run_id} of 2026-11-02 is still queued or running")


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


def test_a_fresh_deployment_starts_from_the_day_that_just_closed(instance):
    assert _requested(_tick(instance, 2)) == ["2026-11-01"]  # the first partition: its window is that day alone
    # No day ever trained or tried: days before the last one may never be meant to train.
    assert _tick(instance, 8).skip_message.startswith(
        "not starting train_and_promote for 2026-11-07: its training window also reads 2026-11-06, where "
        "row_group_cache was never materialized")
    _trained(instance, "2026-11-01")
    assert _requested(_tick(instance, 8)) == ["2026-11-02"]  # closed: 11-01 to 11-07, caught up from 11-02


def test_after_a_pause_longer_than_a_week_the_last_seven_days_are_caught_up_oldest_first(instance):
    _trained(instance, "2026-11-01")
    # Closed: 11-03 to 11-09, none trained or tried; a day older than a week is left to the operator.
    assert _tick(instance, 10).skip_message == (
        "not starting train_and_promote for 2026-11-03: its training window also reads 2026-11-02, where "
        "row_group_cache was never materialized, so lora_adapter would fail. Backfill assets "
        "base_model,raw_examples,training_dataset,row_group_cache for partition 2026-11-02; a later tick then starts "
        "train_and_promote for 2026-11-03 if the backfill ends before 02:00 UTC tomorrow (from then on it is no "
        "longer among the last 7 closed days). Days after it wait their turn: 2026-11-04, 2026-11-05, 2026-11-06, "
        "2026-11-07, 2026-11-08, 2026-11-09")
    instance.report_runless_asset_event(dg.AssetMaterialization("row_group_cache", partition="2026-11-02"))
    assert _requested(_tick(instance, 10, 3)) == ["2026-11-03"]


def test_days_waiting_behind_a_failed_day_keep_their_turn_once_it_leaves_the_last_seven_days(instance):
    for day in ("2026-11-01", "2026-11-02"):
        _trained(instance, day)
    instance.report_run_failed(_launch(instance, _tick(instance, 4)))  # 11-03 failed before its data was built
    # At 11-11 the failed day has left the last seven closed days (11-04 to 11-10): none of them was tried,
    # yet the days behind it still wait for its backfill instead of being given up.
    assert _tick(instance, 11, 3).skip_message == (
        "not starting train_and_promote for 2026-11-04: its training window also reads 2026-11-03, where "
        "row_group_cache was never materialized, so lora_adapter would fail. Backfill assets "
        "base_model,raw_examples,training_dataset,row_group_cache for partition 2026-11-03; a later tick then starts "
        "train_and_promote for 2026-11-04 if the backfill ends before 02:00 UTC tomorrow (from then on it is no "
        "longer among the last 7 closed days). Days after it wait their turn: 2026-11-05, 2026-11-06, 2026-11-07, "
        "2026-11-08, 2026-11-09, 2026-11-10")
    for asset in ("raw_examples", "training_dataset", "row_group_cache"):  # the operator backfills 11-03
        instance.report_runless_asset_event(dg.AssetMaterialization(asset, partition="2026-11-03"))
    assert _requested(_tick(instance, 11, 4)) == ["2026-11-04"]


def _asset_backfill(instance: dg.DagsterInstance, backfill_id: str, days: list[str],
                    asset_names: list[str]) -> PartitionBackfill:
    """As the UI's Materialize over a date range stores it, before the backfill daemon has launched a run."""
    asset_graph = defs.resolve_asset_graph()
    backfill = PartitionBackfill.from_asset_partitions(
        backfill_id=backfill_id, asset_graph=asset_graph, partition_names=days,
        asset_selection=[dg.AssetKey(name) for name in asset_names], backfill_timestamp=time.time(), tags={},
        dynamic_partitions_store=instance, all_partitions=False, title=None, description=None, run_config=None,
    )
    instance.add_backfill(backfill)
    return backfill


def test_a_day_an_unfinished_backfill_targets_waits_for_it_even_between_its_runs(instance):
    _trained(instance, "2026-11-01")
    # Requested, no run yet: the backfill daemon launches one run per stage of the graph, one after the other.
    backfill = _asset_backfill(instance, "wholegraph", ["2026-11-02", "2026-11-03"],
                               [key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys()])
    assert _tick(instance, 4).skip_message == (
        "not starting train_and_promote for 2026-11-02: backfill wholegraph targets that day and has not finished; "
        "a later tick reconsiders 2026-11-02 once it has. Days after it wait their turn: 2026-11-03")
    instance.update_backfill(backfill.with_status(BulkActionStatus.COMPLETED_FAILED))  # it built nothing
    assert _requested(_tick(instance, 4, 3)) == ["2026-11-02"]


def test_a_day_whose_window_day_an_unfinished_backfill_builds_waits_for_it_instead_of_asking_for_one(instance):
    _trained(instance, "2026-11-01")
    instance.report_run_failed(instance.create_run_for_job(JOB, tags={"dagster/partition": "2026-11-02"}))
    _asset_backfill(instance, "data", ["2026-11-02"], ["raw_examples", "training_dataset", "row_group_cache"])
    assert _tick(instance, 4).skip_message == (
        "not starting train_and_promote for 2026-11-03: its training window also reads 2026-11-02, whose "
        "run or backfill is still going (2026-11-02: backfill data not finished); a later tick starts "
        "train_and_promote for 2026-11-03 once it has ended")


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


def test_a_backfill_of_another_code_locations_daily_asset_does_not_hold_a_day_back(instance):
    """An instance may serve other code locations: their backfills build their own data, not Tessera's."""
    from assets.partitions import DAILY

    @dg.asset(partitions_def=DAILY)
    def orders():
        return None

    other_location = dg.Definitions(assets=[orders]).resolve_asset_graph()
    _trained(instance, "2026-11-01")
    for all_partitions in (False, True):
        instance.add_backfill(PartitionBackfill.from_asset_partitions(
            backfill_id=f"orders-{all_partitions}", asset_graph=other_location,
            partition_names=None if all_partitions else ["2026-11-02"], asset_selection=[dg.AssetKey("orders")],
            backfill_timestamp=time.time(), tags={}, dynamic_partitions_store=instance, all_partitions=all_partitions,
            title=None, description=None, run_config=None))
    assert _requested(_tick(instance, 3)) == ["2026-11-02"]


def _run_of_another_location(instance: dg.DagsterInstance, day: str, status: dg.DagsterRunStatus) -> str:
    """A run another code location's daemon queued or started for the same day: its own job and assets."""
    from dagster._core.remote_origin import RegisteredCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin
    from dagster._core.storage.dagster_run import DagsterRun

    origin = RemoteJobOrigin(RemoteRepositoryOrigin(RegisteredCodeLocationOrigin("orders"), "__repository__"),
                             "orders_job")
    return instance.add_run(DagsterRun(job_name="orders_job", run_id=f"orders-{day}-{status.value}", status=status,
                                       tags={"dagster/partition": day}, remote_job_origin=origin,
                                       asset_selection=frozenset({dg.AssetKey("orders")}))).run_id


def test_a_run_of_another_code_location_for_the_same_day_does_not_hold_a_day_back(instance):
    _trained(instance, "2026-11-01")
    _run_of_another_location(instance, "2026-11-02", dg.DagsterRunStatus.STARTED)
    assert _requested(_tick(instance, 3)) == ["2026-11-02"]


@pytest.mark.parametrize("status", [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.STARTING])
def test_a_day_waits_while_its_own_run_or_the_day_befores_is_queued_or_starting(instance, status):
    """On Kubernetes a run waits QUEUED for the run coordinator, then STARTING while its pod is scheduled:
    the day must not start a second run, and the next day must not start training beside it."""
    from dagster._core.remote_origin import RegisteredCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin
    from dagster._core.storage.dagster_run import DagsterRun

    _trained(instance, "2026-11-01")
    instance.report_runless_asset_event(dg.AssetMaterialization("row_group_cache", partition="2026-11-02"))
    origin = RemoteJobOrigin(RemoteRepositoryOrigin(RegisteredCodeLocationOrigin("tessera"), "__repository__"),
                             JOB.name)
    waiting = instance.add_run(DagsterRun(job_name=JOB.name, run_id=f"tessera-{status.value}", status=status,
                                          tags={"dagster/partition": "2026-11-02"}, remote_job_origin=origin))
    assert _tick(instance, 3, 5).skip_message == (
        f"nothing new to start: run {waiting.run_id} of 2026-11-02 is still queued or running")
    assert _tick(instance, 4).skip_message == (
        "not starting train_and_promote for 2026-11-03: its training window also reads 2026-11-02, whose run or "
        f"backfill is still going (2026-11-02: run {waiting.run_id} queued or running); a later tick starts "
        "train_and_promote for 2026-11-03 once it has ended")


def test_a_tick_names_the_relaunched_older_day_still_running_when_the_newest_day_is_done(instance):
    for day in ("2026-11-01", "2026-11-03"):
        _trained(instance, day)
    instance.report_run_failed(instance.create_run_for_job(JOB, tags={"dagster/partition": "2026-11-02"}))
    relaunch = instance.create_run_for_job(JOB, status=dg.DagsterRunStatus.STARTED,
                                           tags={"dagster/partition": "2026-11-02"})  # by hand, from the UI
    assert _tick(instance, 4, 5).skip_message == (
        f"nothing new to start: run {relaunch.run_id} of 2026-11-02 is still queued or running")
