"""Jobs and schedules over the asset graph."""

import dagster as dg

from assets.partitions import DAILY

# The whole graph for one day: what `tessera demo`, a UI launch and the schedule materialize.
demo_job = dg.define_asset_job(
    "train_and_promote",
    selection=dg.AssetSelection.all(),
    partitions_def=DAILY,
    description="raw_examples → training_dataset → row_group_cache → lora_adapter → evaluation → promoted_model",
)

# Daily retraining on the day that just closed, at RETRAIN_HOUR:RETRAIN_MINUTE UTC (the partitions'
# timezone). Unchanged inputs reuse the earlier training run instead of retraining.
RETRAIN_HOUR, RETRAIN_MINUTE = 2, 0
daily_retrain_schedule = dg.build_schedule_from_partitioned_job(
    demo_job, name="daily_retrain", hour_of_day=RETRAIN_HOUR, minute_of_hour=RETRAIN_MINUTE,
    description="retrain on yesterday's partition every day at 02:00 UTC",
)
