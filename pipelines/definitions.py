"""The local code location (workspace.yaml): in-process Ray, SQLite MLflow, state under $TESSERA_HOME."""

import dagster as dg

from pipelines.graph import ASSETS, JOBS
from pipelines.jobs import daily_retrain
from pipelines.resources_local import local_resources
from pipelines.sensors import free_abandoned_runs

# Every run of this location (UI launches, the schedule, backfills) executes its steps in the run's
# own process. The graph is a chain, so a run has no steps to overlap, and Dagster's default
# process-per-step executor made each step re-import torch, transformers and Ray first (~13 s per
# step on two cores); training already runs in Ray's own worker processes.
defs = dg.Definitions(
    assets=ASSETS, jobs=JOBS, schedules=[daily_retrain(embedded_defaults_allowed=True)],
    sensors=[free_abandoned_runs],
    resources=local_resources(storage_set_at_launch=True),
    executor=dg.in_process_executor,
)
