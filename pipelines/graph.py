"""What every code location serves: the assets, jobs and automation. Resources differ per location."""

import dagster as dg

from assets import cache_assets, data_assets, evaluation_assets, model_assets, training_assets
from pipelines.jobs import daily_retrain_schedule, demo_job

ASSETS = dg.load_assets_from_modules([data_assets, model_assets, cache_assets, training_assets, evaluation_assets])
JOBS = [demo_job]
SCHEDULES = [daily_retrain_schedule]
