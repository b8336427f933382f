"""What every code location serves: the assets and jobs. Resources and the schedule's defaults
differ per location (pipelines/jobs.py, daily_retrain)."""

import dagster as dg

from assets import cache_assets, data_assets, evaluation_assets, model_assets, training_assets
from pipelines.jobs import demo_job

ASSETS = dg.load_assets_from_modules([data_assets, model_assets, cache_assets, training_assets, evaluation_assets])
JOBS = [demo_job]
