"""A run launched with a partition tag that names no partition (`dagster job execute --tags
'{"dagster/partition": ...}'`, which unlike `dagster asset materialize --partition` checks nothing) is
refused by its first step, naming the day and the valid range, before anything is written."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone

import dagster as dg
import pytest

TODAY = "today"  # the pinned day, which has not ended: no partition


@pytest.fixture
def today_utc() -> Iterator[str]:
    """Today's UTC day, with Dagster's partitions loaded as of the same instant: a test running across
    00:00 UTC would otherwise name a day that has ended in the meantime, a partition."""
    now = datetime.now(timezone.utc)
    with dg.partition_loading_context(effective_dt=now):
        yield now.date().isoformat()


@pytest.mark.parametrize(("day", "why"), [
    (TODAY, "the last is {last} (a day becomes a partition once it has ended, UTC)"),
    ("2099-01-01", "the last is {last} (a day becomes a partition once it has ended, UTC)"),
    ("2025-10-01", "the first is 2026-11-01"),
])
def test_a_run_tagged_with_a_day_that_is_no_partition_is_refused_before_anything_is_written(
        tmp_path, monkeypatch, today_utc, day, why):
    from assets.partitions import DAILY
    from pipelines.definitions import defs

    day = today_utc if day == TODAY else day

    monkeypatch.setenv("TESSERA_HOME", str(tmp_path / "state"))
    job = defs.resolve_job_def("train_and_promote")
    with dg.DagsterInstance.ephemeral() as instance:
        result = job.execute_in_process(instance=instance, tags={"dagster/partition": day}, raise_on_error=False)
    assert not result.success
    expected = (f"run refused before this step did any work: day {day} is not a partition: "
                + why.format(last=DAILY.get_last_partition_key()))
    failures = {event.step_key: event.step_failure_data.error.message.strip()
                for event in result.get_step_failure_events()}
    # The steps with no upstream ran (and were refused); none of them published anything.
    assert set(failures) == {"raw_examples", "base_model"}
    assert all(message.endswith(expected) for message in failures.values()), failures
    assert not result.get_asset_materialization_events()
    assert not (tmp_path / "state" / "datasets").exists()
    assert not (tmp_path / "state" / "models").exists()


def test_a_partition_day_and_a_range_of_them_pass_and_a_range_ending_today_or_a_malformed_day_is_refused(today_utc):
    from assets.partitions import DAILY, day_that_is_not_a_partition

    last = DAILY.get_last_partition_key()
    for malformed in ("2026-11-31", "20261207", "2026-12-7"):  # Dagster's launch refuses some, not all
        assert day_that_is_not_a_partition({"dagster/partition": malformed}) == (
            f"day {malformed} is not a partition: partitions are days YYYY-MM-DD from 2026-11-01 to {last}")
    assert day_that_is_not_a_partition({}) is None  # an unpartitioned run
    assert day_that_is_not_a_partition({"dagster/partition": last}) is None
    in_range = {"dagster/asset_partition_range_start": "2026-11-01", "dagster/asset_partition_range_end": last}
    assert day_that_is_not_a_partition(in_range) is None
    assert day_that_is_not_a_partition({**in_range, "dagster/asset_partition_range_end": today_utc}) == (
        f"day {today_utc} is not a partition: the last is {last} (a day becomes a partition once it has ended, UTC)")
