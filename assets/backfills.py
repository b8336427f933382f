"""Days Dagster adds to an asset backfill beyond the range it was launched for.

An asset backfill over days (the asset graph's "Materialize" with a date range) targets those days
on its root assets, then every partition downstream of them through the partition mappings. The
training window (assets/partitions.py) maps a day's data to lora_adapter of that day *and* of the
next days inside the window, so a backfill whose range ends on D also runs lora_adapter, evaluation
and promoted_model of D+1, without building D+1's data: it would retrain D+1 with the backfill's
settings, replace its evaluation and could move `champion`. evaluation reads the window's datasets
itself, so a backfill of the data with evaluation adds evaluation and promoted_model of D+1 likewise.
A backfill whose roots are lora_adapter (or a job's backfill: one run per requested day) targets its
requested days only.

A re-execution is judged by the backfill it re-executes: the UI's "Re-execute" of a backfill's run
gives the new run only parent and root run ids (the backfill's tag is dropped once the backfill has
finished), and the backfill page's "Re-execute" starts a new backfill over what did not materialize,
which no longer holds the data the first one built. Both would otherwise train the added day.
"""

from __future__ import annotations

import dagster as dg
from dagster._core.execution.backfill import PartitionBackfill
from dagster._core.storage.tags import BACKFILL_ID_TAG, ROOT_BACKFILL_ID_TAG, ROOT_RUN_ID_TAG

from assets.partitions import earlier_window_days

# What the training window reads of each day: lora_adapter its warmed cache, evaluation its dataset.
WINDOW_DATA_ASSETS = (dg.AssetKey("training_dataset"), dg.AssetKey("row_group_cache"))


def day_added_to_this_backfill(context: dg.AssetExecutionContext) -> str | None:
    """Why this partition is in its run's asset backfill only because Dagster added it (see the
    module's docstring), or None; call before any work. lora_adapter then ends without output
    (output_required=False): the day keeps its earlier model, evaluation and promoted_model are
    skipped, their gates record no verdict, and the backfill, finding nothing materialized, ends
    failed listing the day. evaluation on its own fails instead: its gates are outputs it must give."""
    try:
        run_tags, asset_graph = context.run.tags, context.job_def.asset_layer.asset_graph
    except dg.DagsterError:  # invoked directly (`asset(build_asset_context(), ...)`): no run, no backfill
        return None
    return day_added_beyond_backfill_range(context.instance, run_tags, context.partition_key, asset_graph)


def day_added_beyond_backfill_range(instance: dg.DagsterInstance, run_tags: dict[str, str], day: str,
                                    asset_graph) -> str | None:
    """Why `day` is in the run's asset backfill only through its training window, or None: the
    backfill builds the window's data for an earlier day of `day`'s window but not for `day`."""
    backfill = _original_backfill(instance, run_tags)
    if backfill is None or not backfill.is_asset_backfill:
        return None
    target = backfill.get_asset_backfill_data(asset_graph).target_subset
    built_days = {built_day for key in WINDOW_DATA_ASSETS
                  if (built := target.partitions_subsets_by_asset_key.get(key)) is not None
                  for built_day in built.get_partition_keys()}
    earlier = [earlier_day for earlier_day in earlier_window_days(day) if earlier_day in built_days]
    if day in built_days or not earlier:
        return None
    held = ", ".join(earlier)
    return (
        f"not running {day}: Dagster added day {day} to backfill {backfill.backfill_id} because its training window "
        f"holds {held}, whose data the backfill builds; the backfill does not build {day}'s own data. Run here, {day} "
        f"would be retrained or re-evaluated with this backfill's settings and `champion` possibly moved. Include "
        f"{day} in the backfill's range (its data assets too) to train it; to backfill a range "
        "alone, backfill raw_examples, training_dataset, row_group_cache from the day before it (its first day's "
        "window reads that day) to its last, then lora_adapter, evaluation, promoted_model over the days asked for "
        "(a backfill starting at lora_adapter adds no day)"
    )


def _original_backfill(instance: dg.DagsterInstance, run_tags: dict[str, str]) -> PartitionBackfill | None:
    """The backfill the run's day was first requested by: the run's own, else its root run's (a run
    re-executed from a backfill's run), and of a re-executed backfill the one it re-executes."""
    backfill_id = run_tags.get(BACKFILL_ID_TAG)
    if backfill_id is None and (root_run_id := run_tags.get(ROOT_RUN_ID_TAG)):
        root_run = instance.get_run_by_id(root_run_id)
        backfill_id = root_run.tags.get(BACKFILL_ID_TAG) if root_run else None
    backfill = instance.get_backfill(backfill_id) if backfill_id else None
    root_backfill_id = backfill.tags.get(ROOT_BACKFILL_ID_TAG) if backfill else None
    return instance.get_backfill(root_backfill_id) if root_backfill_id else backfill
