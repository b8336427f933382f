"""`daily_retrain` cases no earlier test reached (each found by a code mutation the suite let through): the
first tried day when the deployment's first run failed or training began outside the job, another code
location's op job, and an unfinished backfill of the later day whose window reads a day."""

from __future__ import annotations

import dagster as dg
from dagster._core.remote_origin import RegisteredCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin
from dagster._core.storage.dagster_run import DagsterRun

from pipelines.definitions import defs
from tests.unit.test_schedule_catch_up import _asset_backfill, _launch, _requested, _succeed, _tick, _trained
from tests.unit.test_schedule_catch_up import _embedded_defaults, instance  # noqa: F401 - fixtures

DATA = ("raw_examples", "training_dataset", "row_group_cache")


def _data_built(instance: dg.DagsterInstance, day: str) -> None:
    for asset in DATA:
        instance.report_runless_asset_event(dg.AssetMaterialization(asset, partition=day))


def test_a_day_between_a_failed_first_day_and_a_later_trained_day_keeps_its_turn(instance):
    """The deployment's first run (11-07) failed; 11-09 trained. The first tried day is 11-07, not the first
    day with a model, so 11-08 is still named (it waits for 11-07) instead of dropped for good."""
    _data_built(instance, "2026-11-06")
    first = _launch(instance, _tick(instance, 8))
    assert first.tags["dagster/partition"] == "2026-11-07"
    instance.report_run_failed(first)  # before it built its data
    _data_built(instance, "2026-11-08")  # the operator backfilled 11-08's data only
    _succeed(instance, _launch(instance, _tick(instance, 10)))  # 11-09 trains
    assert _tick(instance, 10, 5).skip_message.startswith(
        "not starting train_and_promote for 2026-11-08: its training window also reads 2026-11-07")


def test_the_oldest_untrained_day_between_days_trained_outside_the_job_is_next(instance):
    """Models of 11-01 and 11-03 from an asset backfill whose 11-02 failed: 11-02 trains first."""
    _trained(instance, "2026-11-01")
    _trained(instance, "2026-11-03")
    assert _requested(_tick(instance, 5)) == ["2026-11-02"]


def test_an_op_job_run_of_another_code_location_for_the_same_day_does_not_hold_it_back(instance):
    """Another code location's op job (no asset selection) running for 11-02 builds other data."""
    _trained(instance, "2026-11-01")
    origin = RemoteJobOrigin(RemoteRepositoryOrigin(RegisteredCodeLocationOrigin("orders"), "__repository__"),
                             "orders_op_job")
    instance.add_run(DagsterRun(job_name="orders_op_job", run_id="orders-op", status=dg.DagsterRunStatus.STARTED,
                                tags={"dagster/partition": "2026-11-02"}, remote_job_origin=origin))
    assert _requested(_tick(instance, 3)) == ["2026-11-02"]


def test_a_day_waits_while_an_unfinished_backfill_of_the_later_day_reading_it_trains(instance):
    """An operator's whole-graph backfill of 11-03, between its runs, trains 11-03 on 11-02's data: 11-02 must
    not train beside it (its promotion could replace the newer champion)."""
    _trained(instance, "2026-11-01")
    every_asset = [key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys()]
    _asset_backfill(instance, "later", ["2026-11-03"], every_asset)
    assert _tick(instance, 3).skip_message.startswith(
        "not starting train_and_promote for 2026-11-02: 2026-11-03, whose training window reads 2026-11-02")
