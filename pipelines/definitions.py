import dagster as dg

from assets import cache_assets, data_assets, evaluation_assets, model_assets, training_assets
from pipelines.jobs import demo_job
from pipelines.resources_local import local_resources

defs = dg.Definitions(
    assets=dg.load_assets_from_modules([data_assets, model_assets, cache_assets, training_assets, evaluation_assets]),
    jobs=[demo_job],
    resources=local_resources(),
)
