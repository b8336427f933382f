"""The gates' verdicts are stored under the day they judged. Checks declared without partitions on a
daily asset were stored under no day, and the run's day was left "skipped" (or "execution failed"):
the UI's checks of a day, and `assetCheckExecutions(partition: day)`, showed no verdict for it."""

from __future__ import annotations

import json

import dagster as dg
from dagster._core.event_api import PartitionKeyFilter
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus

from training_core.data.demo_task import generate_records
from training_core.data.quality import DATASET_CHECK_NAMES

CLEAN_DAY, DUPLICATED_DAY = "2026-11-05", "2026-11-06"


def test_every_check_of_a_partitioned_asset_is_partitioned_like_it():
    from pipelines.definitions import defs

    graph = defs.resolve_asset_graph()
    checks = {key.to_user_string(): graph.get_check_spec(key) for key in graph.asset_check_keys}
    assert {"evaluation:beats_base_model", "evaluation:not_worse_than_champion"} <= set(checks)
    for name, spec in checks.items():
        assert spec.partitions_def == graph.get(spec.asset_key).partitions_def, name


def _day_records(day: str, exported_twice: bool) -> str:
    distinct = list({(r["prompt"], r["response"]): r for r in generate_records(day, 400)}.values())[:300]
    records = distinct[:150] * 2 if exported_twice else distinct
    return "".join(json.dumps(record) + "\n" for record in records)


def test_each_days_dataset_check_verdicts_are_stored_under_that_day(tmp_path, monkeypatch):
    from pipelines.graph import ASSETS
    from pipelines.resources_local import local_resources

    exports = tmp_path / "exports"
    exports.mkdir()
    (exports / f"{CLEAN_DAY}.jsonl").write_text(_day_records(CLEAN_DAY, exported_twice=False))
    (exports / f"{DUPLICATED_DAY}.jsonl").write_text(_day_records(DUPLICATED_DAY, exported_twice=True))
    home = tmp_path / "home"
    (home / "dagster").mkdir(parents=True)
    monkeypatch.setenv("TESSERA_HOME", str(home))
    instance = dg.DagsterInstance.local_temp(str(home / "dagster"))
    run_config = {"ops": {"raw_examples": {"config": {"source": str(exports / "{partition}.jsonl")}}}}
    run_of_day = {}
    for day in (CLEAN_DAY, DUPLICATED_DAY):
        result = dg.materialize(ASSETS, selection=["base_model", "raw_examples", "training_dataset"],
                                partition_key=day, resources=local_resources(), instance=instance,
                                run_config=run_config, raise_on_error=False)
        run_of_day[day] = result.run_id

    storage = instance.event_log_storage
    for day, failing in ((CLEAN_DAY, set()), (DUPLICATED_DAY, {"no_duplicate_rows"})):
        for name in DATASET_CHECK_NAMES:
            key = dg.AssetCheckKey(dg.AssetKey("training_dataset"), name)
            latest = storage.get_latest_asset_check_execution_by_key([key], PartitionKeyFilter(key=day)).get(key)
            assert latest is not None, f"{name}: nothing stored for {day}"
            expected = (AssetCheckExecutionRecordStatus.FAILED if name in failing
                        else AssetCheckExecutionRecordStatus.SUCCEEDED)
            assert (latest.run_id, latest.status) == (run_of_day[day], expected), f"{name} of {day}"
            assert latest.event.dagster_event.event_specific_data.partition == day
    # No verdict is stored under no day.
    unpartitioned = dg.AssetCheckKey(dg.AssetKey("training_dataset"), "no_duplicate_rows")
    assert storage.get_latest_asset_check_execution_by_key([unpartitioned], PartitionKeyFilter(key=None)) == {}
