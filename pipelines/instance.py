"""The local Dagster instance under $TESSERA_HOME/dagster: telemetry off, training pool of 1."""

import os
import sys
from pathlib import Path

from training_core.errors import ConfigError

INSTANCE_SETTINGS = """\
telemetry:
  enabled: false
nux:
  enabled: false
run_monitoring:
  # dagster dev's daemon fails runs whose process died, which frees their pool slots.
  enabled: true
concurrency:
  pools:
    # Only lora_adapter uses a pool ("training"): at most this many trainings at once.
    default_limit: 1
"""


def prepare_home(home: str | None = None) -> Path:
    """Create the state root and DAGSTER_HOME, and export both for this process."""
    from resources.paths import default_home

    root = Path(home).expanduser().resolve() if home else default_home()
    dagster_home = root / "dagster"
    try:
        dagster_home.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file in the way, no permission, a read-only disk
        raise ConfigError(f"state folder {root} is not usable: {error.strerror or error}") from error
    settings = dagster_home / "dagster.yaml"
    if not settings.exists():
        settings.write_text(INSTANCE_SETTINGS)
    os.environ["TESSERA_HOME"] = str(root)
    os.environ["DAGSTER_HOME"] = str(dagster_home)
    return root


LAUNCHER_TAG = "tessera/launcher"  # `this_process()` of the launching process: host, PID, start time


def fail_abandoned_runs(instance) -> list[str]:
    """Runs started by a `tessera` process that no longer exists (killed mid-training) still hold
    their concurrency-pool slot; mark them failed and free the slot so a relaunch can proceed.
    (Under `dagster dev` the daemon's run monitoring does this.)"""
    import dagster as dg

    from training_core.process_identity import process_is_gone

    abandoned = []
    in_flight = dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING])
    for run in instance.get_runs(filters=in_flight):
        launcher = run.tags.get(LAUNCHER_TAG)
        if launcher is None or not process_is_gone(launcher):
            continue
        instance.report_run_failed(run, f"launcher process {launcher} is gone; marked failed by tessera")
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        abandoned.append(run.run_id)
    return abandoned


if __name__ == "__main__":
    print(prepare_home(sys.argv[1] if len(sys.argv) > 1 else None))
