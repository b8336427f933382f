import warnings
from datetime import date, timedelta

import dagster as dg

# Daily data partitions; the demo uses the first day so its output never depends on today's date.
DAILY = dg.DailyPartitionsDefinition(start_date="2026-11-01")
DEMO_PARTITION = "2026-11-01"

# Training policy: the model for day D trains on the datasets of the last TRAINING_WINDOW_DAYS days
# (D included) and evaluates on their held-out splits. Days before the first partition are skipped;
# days inside the window must be materialized. A scheduled run materializes only its own day, so the
# schedule holds back a day whose earlier window days never were, naming the backfill when nothing is ready.
TRAINING_WINDOW_DAYS = 2
# `allow_nonexistent_upstream_partitions` (Dagster marks it beta) lets the first day train on
# itself alone; its warning is silenced here, where we chose it, not repeated in every log.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=dg.BetaWarning, message=".*allow_nonexistent_upstream_partitions.*")
    TRAINING_WINDOW = dg.TimeWindowPartitionMapping(
        start_offset=-(TRAINING_WINDOW_DAYS - 1), end_offset=0, allow_nonexistent_upstream_partitions=True
    )


def earlier_window_days(day: str) -> list[str]:
    """The days before `day` in its training window, oldest first; none before the first partition."""
    first, current = date.fromisoformat(DAILY.get_first_partition_key()), date.fromisoformat(day)
    earlier = (current - timedelta(days=back) for back in range(TRAINING_WINDOW_DAYS - 1, 0, -1))
    return [earlier_day.isoformat() for earlier_day in earlier if earlier_day >= first]


def later_window_days(day: str) -> list[str]:
    """The days after `day` whose training window holds it, oldest first."""
    current = date.fromisoformat(day)
    return [(current + timedelta(days=ahead)).isoformat() for ahead in range(1, TRAINING_WINDOW_DAYS)]


def materialized_for_day(instance: dg.DagsterInstance, asset: dg.AssetKey | str, day: str) -> bool:
    """Whether `asset` was ever materialized for the partition `day` (a later failed run does not undo it)."""
    key = asset if isinstance(asset, dg.AssetKey) else dg.AssetKey(asset)
    return bool(instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=key, asset_partitions=[day]), limit=1).records)


def daily_blocking_check(name: str, asset: str, description: str) -> dg.AssetCheckSpec:
    """A blocking check of a DAILY asset whose verdicts are stored under the day checked. Without the
    partitions, Dagster stored each verdict under no day and left the run's day "skipped" (or "execution
    failed"): the UI and `assetCheckExecutions(partition: day)` showed no verdict for it. Dagster 1.13
    marks a check's partitions preview; its warning is silenced here, where we chose them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=dg.PreviewWarning,
                                message=".*partitions_def on an AssetCheckSpec.*")
        return dg.AssetCheckSpec(name, asset=asset, blocking=True, partitions_def=DAILY, description=description)


# The run tags a partition or a range of partitions is launched with (Dagster's own names).
PARTITION_TAGS = ("dagster/partition", "dagster/asset_partition_range_start", "dagster/asset_partition_range_end")


def day_that_is_not_a_partition(run_tags: dict[str, str]) -> str | None:
    """Why a day this run was launched for is no partition of DAILY, or None. Only `dagster asset
    materialize --partition` checks the key: a run launched with the tag (`dagster job execute --tags`,
    a UI run's tags) ran raw_examples, published that day's records, then failed in Dagster's IO manager."""
    first, last = DAILY.get_first_partition_key(), DAILY.get_last_partition_key()
    for day in dict.fromkeys(run_tags[tag] for tag in PARTITION_TAGS if tag in run_tags):
        if DAILY.has_partition_key(day):
            continue
        if not _is_iso_day(day):
            why = f"partitions are days YYYY-MM-DD from {first} to {last}"
        elif day < first:  # ISO days order as text
            why = f"the first is {first}"
        else:  # today (not ended yet) or later; before the first day has ended there is no last
            why = f"the last is {last}" if last else f"the first, {first}, has not ended yet"
            why += " (a day becomes a partition once it has ended, UTC)"
        return f"day {day} is not a partition: {why}"
    return None


def _is_iso_day(text: str) -> bool:
    try:
        return date.fromisoformat(text).isoformat() == text  # not 20261207 nor 2026-11-31
    except ValueError:
        return False


def by_partition(value, context: dg.AssetExecutionContext, input_name: str) -> dict:
    """An input over the training window as {partition_key: value}, however many days it spans."""
    if isinstance(value, dict):
        return value
    return {context.asset_partition_keys_for_input(input_name)[0]: value}
