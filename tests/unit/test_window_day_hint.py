"""A step whose training window holds a day never materialized fails loading it, naming every daily
asset to build for that day (and only those it lacks), launched as the UI and the CLI launch assets."""

from __future__ import annotations

import dagster as dg


def _window_hint_definitions() -> dg.Definitions:
    """daily_rows → daily_cache, read over the training window by `windowed`, which also reads
    same_day_only for its own day alone; values stored under $WINDOW_HINT_STORAGE."""
    from assets.partitions import DAILY, TRAINING_WINDOW
    from resources.io_manager import AtomicFilesystemIOManager

    @dg.asset(partitions_def=DAILY)
    def daily_rows(context):
        return context.partition_key

    @dg.asset(partitions_def=DAILY)
    def daily_cache(daily_rows):
        return daily_rows

    @dg.asset(partitions_def=DAILY)
    def same_day_only(context):
        return context.partition_key

    @dg.asset(partitions_def=DAILY, ins={"daily_cache": dg.AssetIn(partition_mapping=TRAINING_WINDOW)})
    def windowed(daily_cache, same_day_only):
        return daily_cache

    return dg.Definitions(assets=[daily_rows, daily_cache, same_day_only, windowed], executor=dg.in_process_executor,
                          resources={"io_manager": AtomicFilesystemIOManager(base_dir=dg.EnvVar("WINDOW_HINT_STORAGE"))})


WINDOW_HINT_DEFS = _window_hint_definitions()


def _window_day_failure(built_before: dict[str, tuple[str, ...]]) -> str:
    """Materializes `built_before` ({day: assets}) from WINDOW_HINT_DEFS' code location, as the UI and
    the CLI launch assets, then `windowed` for 2026-11-03, whose window holds 2026-11-02; returns the
    message of the step's failure."""
    from dagster._core.definitions.reconstruct import ReconstructableRepository

    assets_job = ReconstructableRepository.for_file(__file__, "WINDOW_HINT_DEFS").get_reconstructable_job("__ASSET_JOB")
    with dg.instance_for_test() as instance:
        for day, assets in built_before.items():
            with dg.execute_job(assets_job, instance, tags={"dagster/partition": day},
                                asset_selection=[dg.AssetKey(key) for key in assets]) as built:
                assert built.success
        with dg.execute_job(assets_job, instance, tags={"dagster/partition": "2026-11-03"},
                            asset_selection=[dg.AssetKey("windowed")], raise_on_error=False) as failed:
            (failure,) = failed.get_step_failure_events()
    return failure.step_failure_data.error.cause.message.strip()


def test_a_window_day_never_materialized_is_named_with_what_to_materialize(tmp_path, monkeypatch):
    """The hint names every daily asset the step reads for the missing day and those they are built
    from, in build order: the first day of a backfill trains on the day before it, which no backfill
    may have built."""
    monkeypatch.setenv("WINDOW_HINT_STORAGE", str(tmp_path))
    message = _window_day_failure({"2026-11-03": ("daily_rows", "daily_cache", "same_day_only")})
    assert message.startswith("FileNotFoundError: input 'daily_cache' needs daily_cache partition 2026-11-02, which "
                              "has not been materialized here (no stored value at ")
    assert message.endswith("; materialize daily_rows, daily_cache for partition 2026-11-02 first "
                            "(a backfill of those assets over that day)")


def test_a_window_day_hint_leaves_out_what_that_day_already_has(tmp_path, monkeypatch):
    """daily_rows exists for the missing day: rebuilding it (raw_examples re-reading an export that
    retention may have deleted) is not needed, so only daily_cache is named."""
    monkeypatch.setenv("WINDOW_HINT_STORAGE", str(tmp_path))
    message = _window_day_failure({"2026-11-02": ("daily_rows",),
                                   "2026-11-03": ("daily_rows", "daily_cache", "same_day_only")})
    assert message.endswith("; materialize daily_cache for partition 2026-11-02 first "
                            "(a backfill of those assets over that day)")
