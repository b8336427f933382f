"""Which process runs a Dagster run, recorded as a run tag so that a later process can free the
training pool slot of a run whose process was killed (`pipelines.instance.fail_abandoned_runs`).

`tessera demo` sets the tag when it launches. A run started otherwise (the Dagster CLI, a script)
gets it from its training step, the one step that holds a pool slot: with the local code
location's in-process executor the step's process is the run's. A process on another host (a
Kubernetes step pod) is never judged from here, so the tag is harmless there."""

from __future__ import annotations

import dagster as dg

LAUNCHER_TAG = "tessera/launcher"  # `this_process()` of the launching process: host, PID, start time


def record_this_process(context: dg.AssetExecutionContext) -> None:
    """Tag the run with this process unless its launcher already did."""
    from training_core.process_identity import this_process

    if LAUNCHER_TAG not in context.run.tags:
        context.instance.add_run_tags(context.run_id, {LAUNCHER_TAG: this_process()})
