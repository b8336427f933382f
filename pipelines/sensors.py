"""Sensors of the local code location."""

import dagster as dg

from pipelines.instance import fail_abandoned_runs

SWEEP_INTERVAL_S = 60


@dg.sensor(
    name="free_abandoned_runs", minimum_interval_seconds=SWEEP_INTERVAL_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="every minute, mark failed the runs whose process on this host is gone (tag tessera/launcher: "
                "a killed `tessera demo`, a machine restarted mid-run), freeing the training pool slot they held; "
                "`tessera free-slots` does the same by hand",
)
def free_abandoned_runs(context: dg.SensorEvaluationContext):
    # dagster dev's code server fails the runs it launched whose process died, but not those of a process
    # it did not launch, nor any after a restart of dagster dev itself: those stayed STARTED, holding the
    # pool slot, and the schedule waited behind them for ever.
    freed = fail_abandoned_runs(context.instance)
    return dg.SkipReason(f"marked failed, their process being gone: {', '.join(freed)}" if freed
                         else "no run abandoned by a killed process")
