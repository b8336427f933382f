import warnings

import dagster as dg

# Daily data partitions; the demo uses the first day so its output never depends on today's date.
DAILY = dg.DailyPartitionsDefinition(start_date="2026-11-01")
DEMO_PARTITION = "2026-11-01"

# Training policy: the model for day D trains on the datasets of the last TRAINING_WINDOW_DAYS days
# (D included) and evaluates on their held-out splits. Days before the first partition are skipped;
# days inside the window must be materialized. A scheduled run materializes only its own day, so the
# schedule skips a day whose earlier window days never were (a fresh deployment), naming the backfill.
TRAINING_WINDOW_DAYS = 2
# `allow_nonexistent_upstream_partitions` (Dagster marks it beta) lets the first day train on
# itself alone; its warning is silenced here, where we chose it, not repeated in every log.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=dg.BetaWarning, message=".*allow_nonexistent_upstream_partitions.*")
    TRAINING_WINDOW = dg.TimeWindowPartitionMapping(
        start_offset=-(TRAINING_WINDOW_DAYS - 1), end_offset=0, allow_nonexistent_upstream_partitions=True
    )


def by_partition(value, context: dg.AssetExecutionContext, input_name: str) -> dict:
    """An input over the training window as {partition_key: value}, however many days it spans."""
    if isinstance(value, dict):
        return value
    return {context.asset_partition_keys_for_input(input_name)[0]: value}
