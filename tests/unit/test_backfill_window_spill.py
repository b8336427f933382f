"""An asset backfill over days (the asset graph's "Materialize" with a date range) also targets
lora_adapter, evaluation and promoted_model of the day after the range: that day's training window
reads the range's last day. lora_adapter skips such a day before any work, naming the backfill;
the days asked for train as before. Real Dagster backfills in a test instance; no run of training."""

from __future__ import annotations

import logging
import pickle
import time

import dagster as dg
import pytest
from dagster._core.execution.backfill import PartitionBackfill

from assets.backfills import day_added_beyond_backfill_range
from pipelines.definitions import defs
from assets.training_assets import TrainedModel
from training_core.base_model import BaseModelRef

RANGE = ["2026-11-02", "2026-11-03"]
AFTER_RANGE = "2026-11-04"
WHOLE_GRAPH = ["raw_examples", "training_dataset", "row_group_cache", "base_model", "lora_adapter", "evaluation",
               "promoted_model"]


def _asset_backfill(instance: dg.DagsterInstance, backfill_id: str, asset_names: list[str]) -> PartitionBackfill:
    """As `launchPartitionBackfill` with assetSelection and partitionNames (the UI's Materialize) stores it."""
    backfill = PartitionBackfill.from_asset_partitions(
        backfill_id=backfill_id, asset_graph=defs.resolve_asset_graph(), partition_names=RANGE,
        asset_selection=[dg.AssetKey(name) for name in asset_names], backfill_timestamp=time.time(), tags={},
        dynamic_partitions_store=instance, all_partitions=False, title=None, description=None, run_config=None,
    )
    instance.add_backfill(backfill)
    return backfill


def _targeted_days(backfill: PartitionBackfill, asset_name: str) -> list[str]:
    target = backfill.get_asset_backfill_data(defs.resolve_asset_graph()).target_subset
    return sorted(target.get_partitions_subset(dg.AssetKey(asset_name)).get_partition_keys())


def _added(instance: dg.DagsterInstance, backfill_id: str, day: str) -> str | None:
    return day_added_beyond_backfill_range(instance, {"dagster/backfill": backfill_id}, day,
                                           defs.resolve_asset_graph())


def test_the_day_after_a_whole_graph_backfills_range_is_named_as_added_by_dagster():
    with dg.instance_for_test() as instance:
        backfill = _asset_backfill(instance, "wholegraph", WHOLE_GRAPH)
        # Dagster's own target: the data of the range, training of the range and of the day after it.
        assert _targeted_days(backfill, "row_group_cache") == RANGE
        assert _targeted_days(backfill, "lora_adapter") == [*RANGE, AFTER_RANGE]
        assert _targeted_days(backfill, "promoted_model") == [*RANGE, AFTER_RANGE]

        added = _added(instance, "wholegraph", AFTER_RANGE)
        assert added is not None and added.startswith(
            f"not running {AFTER_RANGE}: Dagster added day {AFTER_RANGE} to backfill wholegraph because its "
            f"training window holds {RANGE[-1]}, whose data the backfill builds")
        assert f"Include {AFTER_RANGE} in the backfill's range" in added
        assert [_added(instance, "wholegraph", day) for day in RANGE] == [None, None]


def test_evaluation_of_the_day_after_a_backfill_of_data_and_evaluation_is_named_as_added_too():
    # evaluation reads training_dataset over the window itself: without lora_adapter in the backfill
    # it would re-score that day's stored model with the backfill's gate settings and could promote it.
    with dg.instance_for_test() as instance:
        backfill = _asset_backfill(instance, "dataeval", ["raw_examples", "training_dataset", "evaluation",
                                                          "promoted_model"])
        assert _targeted_days(backfill, "evaluation") == [*RANGE, AFTER_RANGE]
        assert _added(instance, "dataeval", AFTER_RANGE) is not None
        assert [_added(instance, "dataeval", day) for day in RANGE] == [None, None]


def test_a_backfill_starting_at_lora_adapter_adds_no_day_and_trains_every_day_it_holds():
    """The two-step backfill the refusal advises: the data over the range, then training over it."""
    with dg.instance_for_test() as instance:
        data = _asset_backfill(instance, "data", ["raw_examples", "training_dataset", "row_group_cache"])
        training = _asset_backfill(instance, "training", ["lora_adapter", "evaluation", "promoted_model"])
        assert _targeted_days(data, "row_group_cache") == RANGE
        assert _targeted_days(training, "lora_adapter") == _targeted_days(training, "promoted_model") == RANGE
        assert [_added(instance, "training", day) for day in RANGE] == [None, None]
        # Not a backfill's run (a UI launch, the schedule): nothing to refuse.
        assert day_added_beyond_backfill_range(instance, {}, AFTER_RANGE, defs.resolve_asset_graph()) is None


def test_a_backfill_rewarming_the_cache_and_retraining_names_the_added_day_too():
    """Re-warming the cache of published days and retraining them: Dagster still adds the day after."""
    with dg.instance_for_test() as instance:
        backfill = _asset_backfill(instance, "rewarm", ["row_group_cache", "lora_adapter", "evaluation",
                                                         "promoted_model"])
        assert _targeted_days(backfill, "lora_adapter") == [*RANGE, AFTER_RANGE]
        assert _added(instance, "rewarm", AFTER_RANGE) is not None
        assert [_added(instance, "rewarm", day) for day in RANGE] == [None, None]


def test_the_runs_of_a_job_pages_backfill_are_not_judged_as_an_asset_backfills():
    """The job page's backfill of train_and_promote: one run per requested day, nothing added."""
    from dagster._core.execution.backfill import BulkActionStatus

    with dg.instance_for_test() as instance:
        instance.add_backfill(PartitionBackfill(backfill_id="jobpage", status=BulkActionStatus.REQUESTED,
                                                from_failure=False, tags={}, backfill_timestamp=time.time(),
                                                partition_names=RANGE))
        assert _added(instance, "jobpage", RANGE[-1]) is None


class _NeverMaterializedInputs(dg.IOManager):
    """Upstream values of a run the training step must refuse before it reads any of them."""

    def load_input(self, context: dg.InputContext):
        if context.name == "base_model":  # the inputs Dagster type-checks
            return BaseModelRef("never-read", "never-read", parameters=0, vocab_size=None, source="demo")
        if context.name == "lora_adapter":
            return TrainedModel("never-read", "lora", "never-read", "never-read", "never-read", 0.0)
        return None

    def handle_output(self, context: dg.OutputContext, obj) -> None:
        raise AssertionError("lora_adapter stored a value: it trained")


def _materialize_added_day(tmp_path, instance: dg.DagsterInstance, asset: str) -> dg.ExecuteInProcessResult:
    from pipelines.graph import ASSETS
    from pipelines.resources_local import local_resources
    from resources import MlflowTracker, RowGroupCache, TesseraStorage

    storage = TesseraStorage(home=str(tmp_path))
    resources = {**local_resources(), "storage": storage, "mlflow_tracker": MlflowTracker(storage=storage),
                 "cache": RowGroupCache(storage=storage), "io_manager": _NeverMaterializedInputs()}
    _asset_backfill(instance, "wholegraph", WHOLE_GRAPH)
    return dg.materialize(ASSETS, selection=[asset], partition_key=AFTER_RANGE, instance=instance,
                          resources=resources, tags={"dagster/backfill": "wholegraph"})


ADDED_DAY = f"not running {AFTER_RANGE}: Dagster added day {AFTER_RANGE} to backfill wholegraph because"


def test_training_ends_without_output_on_the_added_day_before_any_work(tmp_path):
    with dg.instance_for_test() as instance:
        result = _materialize_added_day(tmp_path, instance, "lora_adapter")
        warnings = [entry.user_message for entry in instance.all_logs(result.run_id)
                    if entry.level == logging.WARNING]
    # No materialization (the day's earlier model stands), the reason a warning in the run.
    assert result.success and result.get_asset_materialization_events() == []
    assert any(message.startswith(ADDED_DAY) for message in warnings), warnings
    assert [path.name for path in tmp_path.iterdir()] == []  # no model, Ray run, MLflow store or download


def test_evaluation_refuses_the_added_day_before_any_work(tmp_path):
    """Its gates are outputs the step must give: it fails rather than ending without output."""
    with dg.instance_for_test() as instance, pytest.raises(dg.Failure, match=f"^{ADDED_DAY}"):
        _materialize_added_day(tmp_path, instance, "evaluation")
    assert [path.name for path in tmp_path.iterdir()] == []


def test_the_added_day_without_data_fails_loading_it_with_the_backfill_named(tmp_path):
    """Dagster loads inputs before the asset runs: where the added day's data was never built, the
    load fails first, and says why that day is in the backfill; a day the backfill asked for does not."""
    from pipelines.graph import ASSETS
    from pipelines.resources_local import local_resources
    from resources.io_manager import AtomicFilesystemIOManager

    resources = {**local_resources(), "io_manager": AtomicFilesystemIOManager(base_dir=str(tmp_path))}
    (tmp_path / "base_model").write_bytes(pickle.dumps(
        BaseModelRef("never-read", "never-read", parameters=0, vocab_size=None, source="demo")))
    with dg.instance_for_test() as instance:
        _asset_backfill(instance, "wholegraph", WHOLE_GRAPH)
        failures = {}
        for day in (AFTER_RANGE, RANGE[-1]):
            with pytest.raises(FileNotFoundError) as failed:
                dg.materialize(ASSETS, selection=["lora_adapter"], partition_key=day, instance=instance,
                               resources=resources, tags={"dagster/backfill": "wholegraph"})
            failures[day] = str(failed.value)
    assert failures[AFTER_RANGE].startswith("input 'row_group_cache' needs row_group_cache partition ")
    assert (f". not running {AFTER_RANGE}: Dagster added day {AFTER_RANGE} to backfill wholegraph because"
            in failures[AFTER_RANGE])
    assert "Dagster added" not in failures[RANGE[-1]]  # a day asked for: only "materialize it first"
