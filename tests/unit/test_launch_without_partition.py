"""A run of daily assets launched with no day (the Launchpad with no partition picked, `dagster job
execute -j train_and_promote` without a partition tag) is refused by its first steps, naming the assets
and how to pick a day, before anything is written; it used to write base_model, then fail on Dagster's
"Cannot access partition_key for a non-partitioned run". base_model alone needs no day."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from dagster._core.definitions.reconstruct import ReconstructableRepository

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]
DAILY_ASSETS = "raw_examples, training_dataset, row_group_cache, lora_adapter, evaluation, promoted_model"


def _how_to_pick_a_day(launch: str) -> str:
    from assets.partitions import DAILY

    day = DAILY.get_last_partition_key()
    return (f"{launch} for one day (the last partition is {day}; pick it in the Launchpad, or pass "
            f"`--partition {day}` to `dagster asset materialize`, `--tags '{{\"dagster/partition\": \"{day}\"}}'` "
            "to `dagster job execute`), or launch a backfill over a range of days")


def _step_failures(result) -> dict[str, str]:
    return {event.step_key: event.step_failure_data.error.message.strip() for event in result.get_step_failure_events()}


def _nothing_written(state: Path) -> None:
    assert not (state / "datasets").exists()
    assert not (state / "models").exists()


def test_train_and_promote_launched_for_no_day_is_refused_before_base_model_is_written(tmp_path, monkeypatch):
    from pipelines.definitions import defs

    monkeypatch.setenv("TESSERA_HOME", str(tmp_path / "state"))
    job = defs.resolve_job_def("train_and_promote")
    with dg.DagsterInstance.ephemeral() as instance:
        result = job.execute_in_process(instance=instance, raise_on_error=False)  # no dagster/partition tag
    assert not result.success
    expected = (f"run refused before this step did any work: {DAILY_ASSETS} are partitioned by day and this run "
                "names no day: " + _how_to_pick_a_day("launch train_and_promote"))
    failures = _step_failures(result)
    assert set(failures) == {"raw_examples", "base_model"}  # the steps with no upstream; the rest never ran
    assert all(message.endswith(expected) for message in failures.values()), failures
    assert not result.get_asset_materialization_events()
    _nothing_written(tmp_path / "state")


def test_assets_picked_in_the_ui_with_no_day_are_refused_and_base_model_alone_is_built(tmp_path, monkeypatch):
    """Launched as the UI and `dagster asset materialize` launch assets: Dagster's __ASSET_JOB run with an
    asset selection, executed from the code location (the job subset in the run's own process)."""
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path / "state"))
    repository = ReconstructableRepository.for_module("pipelines.definitions", "defs",
                                                      working_directory=str(REPOSITORY_ROOT))
    assets_job = repository.get_reconstructable_job("__ASSET_JOB")
    with dg.instance_for_test() as instance:
        with dg.execute_job(assets_job, instance, asset_selection=[dg.AssetKey("raw_examples")],
                            raise_on_error=False) as refused:
            assert not refused.success
            assert _step_failures(refused) == {"raw_examples": (
                "dagster._core.definitions.events.Failure: run refused before this step did any work: raw_examples "
                "is partitioned by day and this run names no day: " + _how_to_pick_a_day("materialize raw_examples"))}
            assert not refused.get_asset_materialization_events()
        _nothing_written(tmp_path / "state")
        with dg.execute_job(assets_job, instance, asset_selection=[dg.AssetKey("base_model")]) as built:
            assert built.success  # unpartitioned: a run with no day is how it is built
            built_assets = [event.asset_key for event in built.get_asset_materialization_events()]
            assert built_assets == [dg.AssetKey("base_model")]


@pytest.mark.parametrize("tags", [
    {"dagster/partition": "2026-11-01"},
    {"dagster/asset_partition_range_start": "2026-11-01", "dagster/asset_partition_range_end": "2026-11-02"},
])
def test_a_run_for_a_day_or_a_backfill_range_is_not_refused_for_want_of_one(tags):
    from assets.launch_checks import daily_assets_run_for_no_day
    from pipelines.definitions import defs

    job = defs.resolve_job_def("train_and_promote")
    assert daily_assets_run_for_no_day(job, tags) is None
    assert daily_assets_run_for_no_day(job, {}) is not None
