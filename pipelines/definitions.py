"""The local code location (workspace.yaml): in-process Ray, SQLite MLflow, state under $TESSERA_HOME."""

import dagster as dg

from pipelines.graph import ASSETS, JOBS, SCHEDULES
from pipelines.resources_local import local_resources

defs = dg.Definitions(assets=ASSETS, jobs=JOBS, schedules=SCHEDULES, resources=local_resources())
