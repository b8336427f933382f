"""Which process runs a Dagster run, recorded as a run tag so that a later process can free the
training pool slot of a run whose process was killed (`pipelines.instance.fail_abandoned_runs`).

`tessera demo` sets the tag when it launches. A run started otherwise (the Dagster CLI, a script)
gets it from its training step, the one step that holds a pool slot: with the local code
location's in-process executor the step's process is the run's. A process on another host (a
Kubernetes step pod) is never judged from here, so the tag is harmless there; the MLflow run such a
pod left RUNNING is judged by its Dagster run instead (`ended_dagster_run_status`)."""

from __future__ import annotations

from collections.abc import Callable

import dagster as dg

LAUNCHER_TAG = "tessera/launcher"  # `this_process()` of the launching process: host, PID, start time


def record_this_process(context: dg.AssetExecutionContext) -> None:
    """Tag the run with this process unless its launcher already did. A tag copied from the parent
    run (a re-execution from the UI or the run-retry daemon copies the parent's tags) names the
    parent's process, so it is replaced."""
    from training_core.process_identity import this_process

    if LAUNCHER_TAG not in context.run.tags or inherited_launcher_tag(context.instance, context.run):
        context.instance.add_run_tags(context.run_id, {LAUNCHER_TAG: this_process()})


def inherited_launcher_tag(instance: dg.DagsterInstance, run: dg.DagsterRun) -> bool:
    """Whether the run's launcher tag was copied from the run it re-executes: it then names the
    parent's process (usually gone), not the one running this run."""
    parent_id = run.tags.get("dagster/parent_run_id")
    if parent_id is None or LAUNCHER_TAG not in run.tags:
        return False
    parent = instance.get_run_by_id(parent_id)
    # a parent deleted since: the tag cannot be told apart, so it is not trusted either
    return parent is None or parent.tags.get(LAUNCHER_TAG) == run.tags[LAUNCHER_TAG]


def ended_dagster_run_status(instance: dg.DagsterInstance, current_run_id: str) -> Callable[[str], str | None]:
    """For `MlflowTracking.end_abandoned_runs`: the status a Dagster run ended with (SUCCESS,
    FAILURE, CANCELED), or None for one still going, unknown to this instance, or the current run.
    Its MLflow run was then left RUNNING by a step process that is gone, whatever host it ran on."""

    def run_has_ended(run_id: str) -> str | None:
        if run_id == current_run_id:
            return None
        run = instance.get_run_by_id(run_id)
        return run.status.value if run is not None and run.is_finished else None

    return run_has_ended
