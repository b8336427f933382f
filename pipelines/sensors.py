"""Sensors of the local code location."""

import dagster as dg

from pipelines.instance import free_training_pool

SWEEP_INTERVAL_S = 60


@dg.sensor(
    name="free_abandoned_runs", minimum_interval_seconds=SWEEP_INTERVAL_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="every minute, mark failed the runs whose process on this host is gone (tag tessera/launcher: "
                "a killed `tessera demo`, a machine restarted mid-run), freeing the training pool slot they held, "
                "and free the slots that ended runs still hold; `tessera free-slots` does the same by hand",
)
def free_abandoned_runs(context: dg.SensorEvaluationContext):
    # dagster dev's code server fails the runs it launched whose process died, but not those of a process
    # it did not launch, nor any after a restart of dagster dev itself: those stayed STARTED, holding the
    # pool slot, and the schedule waited behind them for ever.
    # The runs the code server failed keep their slot too (it frees none), and so would every run that ended
    # in an instance made before its dagster.yaml had the daemon free them.
    done = []
    failed, released = free_training_pool(context.instance)
    if failed:
        done.append(f"marked failed, their process being gone: {', '.join(failed)}")
    if released:
        done.append(f"freed the pool slots that ended runs still held: {', '.join(released)}")
    return dg.SkipReason("; ".join(done) or "no run abandoned by a killed process, no slot held by an ended run")
