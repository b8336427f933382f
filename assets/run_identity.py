"""Which process runs a Dagster run, recorded as a run tag so that a later process can fail a run whose
process was killed, freeing the training pool slot it held (`pipelines.instance.fail_abandoned_runs`):
left STARTED, it held the slot, and the schedule waited behind its day for ever.

`tessera demo` sets the tag when it launches. A run started otherwise (the UI, the schedule, the
Dagster CLI, a script) gets it from its first step (`assets.step_start`), or, where the run trains,
earlier, when its process sets up its resources (`resources.run_process`): a step that waits for
the training pool's slot starts only once it has it. With the local code location's in-process
executor every step's process is the run's. A process on another host (a
Kubernetes step pod) is never judged from here, so the tag is harmless there; the MLflow run such a
pod left RUNNING is judged by its Dagster run instead (`ended_dagster_run_status`)."""

from __future__ import annotations

from collections.abc import Callable

import dagster as dg

LAUNCHER_TAG = "tessera/launcher"  # `this_process()` of the launching process: host, PID, start time


def record_this_process(context: dg.AssetExecutionContext) -> None:
    """`record_run_process` for a step's run; nothing for an asset invoked directly."""
    try:
        run_id = context.run.run_id
    except dg.DagsterError:  # invoked directly (`asset(build_asset_context(), ...)`): no run to tag
        return
    record_run_process(context.instance, run_id)


def record_run_process(instance: dg.DagsterInstance, run_id: str) -> None:
    """Tag the run with this process unless its launcher already did. A tag copied from the parent
    run (a re-execution from the UI or the run-retry daemon copies the parent's tags) names the
    parent's process, so it is replaced. The run is read afresh: an earlier step may have tagged it."""
    from training_core.process_identity import this_process

    run = instance.get_run_by_id(run_id)
    if run is not None and (LAUNCHER_TAG not in run.tags or inherited_launcher_tag(instance, run)):
        instance.add_run_tags(run_id, {LAUNCHER_TAG: this_process()})


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
