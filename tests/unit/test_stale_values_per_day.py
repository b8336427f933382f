"""A per-day value stored by an earlier version, before a field was added, is refused like an
unpartitioned one: every stored Tessera value but base_model is per day, and a PublishedDataset from
before `failed_checks` would otherwise read as one whose gates passed."""

from __future__ import annotations

import dataclasses
import pickle

import dagster as dg
import pytest


@dataclasses.dataclass(frozen=True)
class DayValue:
    path: str
    failed_checks: tuple | None = None  # as PublishedDataset's: None must not be read from an older value


def test_a_per_day_value_stored_before_a_field_was_added_is_refused_naming_its_day(tmp_path):
    from assets.partitions import DAILY
    from resources.io_manager import AtomicFilesystemIOManager, StaleValueError

    @dg.asset(partitions_def=DAILY)
    def stored() -> DayValue:
        return DayValue("/v1", ())

    @dg.asset(partitions_def=DAILY)
    def reader(stored: DayValue):
        return stored.failed_checks

    resources = {"io_manager": AtomicFilesystemIOManager(base_dir=str(tmp_path))}
    with dg.instance_for_test() as instance:
        assert dg.materialize([stored], partition_key="2026-11-03", instance=instance, resources=resources).success
        older = DayValue("/v0", ())
        object.__delattr__(older, "failed_checks")  # as the earlier version pickled it
        (tmp_path / "stored" / "2026-11-03").write_bytes(pickle.dumps(older))
        with pytest.raises(StaleValueError, match=r"stored partition 2026-11-03 .*DayValue lacks failed_checks"):
            dg.materialize([stored, reader], selection=[reader], partition_key="2026-11-03", instance=instance,
                           resources=resources)
