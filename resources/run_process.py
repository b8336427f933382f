"""Records which process runs a Dagster run (`assets.run_identity`) when the run sets up its resources."""

from __future__ import annotations

import dagster as dg

from assets.run_identity import record_run_process


class RunProcess(dg.ConfigurableResource):
    """A resource of the training step whose setup tags the run with its process. The in-process executor
    sets up every resource of the run's steps before the first step starts, and a step of the training pool
    starts only once it holds the slot: a run of lora_adapter alone, killed while it waited, was left with
    no tag, STARTED for ever, and the slot Dagster hands to it next was never freed."""

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        if context.dagster_run is not None and context.instance is not None:  # not for a resource built by hand
            record_run_process(context.instance, context.dagster_run.run_id)
