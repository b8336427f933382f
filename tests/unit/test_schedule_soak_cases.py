"""Cases a simulated month of hourly `daily_retrain` ticks found (runs of random length that fail or are
canceled, daemon outages, operators' backfills): each once let two runs write one day, trained a day beside
the later day that reads it, dropped a day for good, or advised what a later tick then did not do."""

from __future__ import annotations

import dagster as dg

from assets.partitions import DAILY
from tests.unit.test_schedule_catch_up import JOB, _launch, _requested, _succeed, _tick, _trained
from tests.unit.test_schedule_catch_up import _embedded_defaults, instance  # noqa: F401 - fixtures

DATA = ("raw_examples", "training_dataset", "row_group_cache")


def _data_built(instance: dg.DagsterInstance, day: str) -> None:
    for asset in DATA:
        instance.report_runless_asset_event(dg.AssetMaterialization(asset, partition=day))


def test_a_canceling_run_still_holds_its_day_and_the_next(instance):
    """CANCELING: the run's process is still stopping, and may still be writing the day."""
    _trained(instance, "2026-11-01")
    run_1102 = _launch(instance, _tick(instance, 3))
    _data_built(instance, "2026-11-02")  # its data steps are done, its training goes on
    instance.report_run_canceling(instance.get_run_by_id(run_1102.run_id))
    assert instance.get_run_by_id(run_1102.run_id).status == dg.DagsterRunStatus.CANCELING
    assert _tick(instance, 4).skip_message == (
        "not starting train_and_promote for 2026-11-03: its training window also reads 2026-11-02, whose run or "
        f"backfill is still going (2026-11-02: run {run_1102.run_id} queued or running); a later tick starts "
        "train_and_promote for 2026-11-03 once it has ended")
    assert _tick(instance, 3, 5).skip_message == (
        f"nothing new to start: run {run_1102.run_id} of 2026-11-02 is still queued or running")


def test_a_day_waits_while_the_later_day_whose_window_reads_it_trains(instance):
    """11-03 waited behind 11-02's long run, so 11-04 started; once 11-02 ended, 11-03 started beside 11-04,
    rewriting the data 11-04 trains on, and its promotion could replace 11-04's newer champion."""
    _trained(instance, "2026-11-01")
    run_1102 = _launch(instance, _tick(instance, 3))
    _data_built(instance, "2026-11-03")  # backfilled by an operator: no training
    _data_built(instance, "2026-11-02")  # 11-02's run built its data and trains on
    run_1104 = _launch(instance, _tick(instance, 5))
    assert run_1104.tags["dagster/partition"] == "2026-11-04"
    _succeed(instance, run_1102)
    assert _tick(instance, 5, 3).skip_message == (
        "not starting train_and_promote for 2026-11-03: 2026-11-04, whose training window reads 2026-11-03, is being "
        f"built (2026-11-04: run {run_1104.run_id} queued or running); a later tick starts train_and_promote for "
        "2026-11-03 once it has ended")
    _succeed(instance, run_1104)
    assert _requested(_tick(instance, 5, 4)) == ["2026-11-03"]


def test_a_day_waiting_behind_a_failed_day_keeps_its_turn_after_later_days_trained(instance):
    """11-03 failed; 11-04 waits for its data; 11-05 to 11-10 train. Once 11-03 left the last seven days,
    the first tried day among them was 11-05, and 11-04 was dropped for good."""
    for day in ("2026-11-01", "2026-11-02"):
        _trained(instance, day)
    instance.report_run_failed(_launch(instance, _tick(instance, 4)))  # 11-03, before its data was built
    _data_built(instance, "2026-11-04")
    for day in range(6, 12):  # 11-05 .. 11-10, each while 11-04 waits; from 11-11, 11-03 is out of the last 7
        _succeed(instance, _launch(instance, _tick(instance, day)))
    assert _tick(instance, 11, 3).skip_message.startswith(
        "not starting train_and_promote for 2026-11-04: its training window also reads 2026-11-03")
    _data_built(instance, "2026-11-03")  # the operator follows the advice
    assert _requested(_tick(instance, 11, 4)) == ["2026-11-04"]


def test_a_fresh_deployments_advice_says_until_when_it_holds(instance):
    """No day has trained: each day's ticks consider the day that just closed only, so the backfill the
    skip asks for must end before the next day closes."""
    assert _tick(instance, 8).skip_message == (
        "not starting train_and_promote for 2026-11-07: its training window also reads 2026-11-06, where "
        "row_group_cache was never materialized, so lora_adapter would fail. Backfill assets "
        "base_model,raw_examples,training_dataset,row_group_cache for partition 2026-11-06; a later tick then starts "
        "train_and_promote for 2026-11-07 if the backfill ends before 02:00 UTC tomorrow (no day has trained yet: "
        "each day's ticks consider the day that just closed only)")
    _data_built(instance, "2026-11-06")
    assert _requested(_tick(instance, 8, 9)) == ["2026-11-07"]



def test_the_demo_tried_first_on_the_deployments_instance_leaves_the_deployment_fresh(instance):
    """`tessera demo` trains 2026-11-01 on the same instance as `make ui`: its run is no retraining, and
    counting it made every one of the last seven days look left behind, the oldest first."""
    from pipelines.cli import demo_run_tags

    demo_tags = {**demo_run_tags(), "dagster/partition": "2026-11-01"}
    instance.create_run_for_job(JOB, status=dg.DagsterRunStatus.SUCCESS, tags=demo_tags)

    @dg.asset(name="lora_adapter", partitions_def=DAILY)
    def demo_lora_adapter():
        return None

    assert dg.materialize([demo_lora_adapter], instance=instance, partition_key="2026-11-01", tags=demo_tags).success
    skip = _tick(instance, 30).skip_message
    assert skip.startswith("not starting train_and_promote for 2026-11-29: its training window also reads 2026-11-28")
    assert skip.endswith("(no day has trained yet: each day's ticks consider the day that just closed only)")
    _data_built(instance, "2026-11-28")
    assert _requested(_tick(instance, 30, 3)) == ["2026-11-29"]
