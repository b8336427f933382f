"""The local Dagster instance under $TESSERA_HOME/dagster: telemetry off, training pool of 1."""

import os
import socket
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


LAUNCHER_TAG = "tessera/launcher"  # "<host>:<pid>:<process start time>" of the launching process


def launcher_tag() -> str:
    """This process, identified so that a later process reusing its PID is not taken for it."""
    import psutil

    return f"{socket.gethostname()}:{os.getpid()}:{psutil.Process().create_time():.3f}"


def launcher_is_gone(tag: str) -> bool:
    """True only when the tagged process certainly no longer runs: same host, and its PID is free
    or now belongs to a process started at another time. A launcher on another host is never
    judged from here (its own `tessera` or the daemon's run monitoring handles it)."""
    import psutil

    rest = tag.split(":")
    if len(rest) < 3 or not rest[-2].isdigit():
        return False  # not written by launcher_tag: leave the run alone
    host, pid, started = ":".join(rest[:-2]), int(rest[-2]), rest[-1]
    if host != socket.gethostname():
        return False
    try:
        return f"{psutil.Process(pid).create_time():.3f}" != started
    except psutil.NoSuchProcess:
        return True


def fail_abandoned_runs(instance) -> list[str]:
    """Runs started by a `tessera` process that no longer exists (killed mid-training) still hold
    their concurrency-pool slot; mark them failed and free the slot so a relaunch can proceed.
    (Under `dagster dev` the daemon's run monitoring does this.)"""
    import dagster as dg

    abandoned = []
    in_flight = dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING])
    for run in instance.get_runs(filters=in_flight):
        launcher = run.tags.get(LAUNCHER_TAG)
        if launcher is None or not launcher_is_gone(launcher):
            continue
        instance.report_run_failed(run, f"launcher process {launcher} is gone; marked failed by tessera")
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        abandoned.append(run.run_id)
    return abandoned


if __name__ == "__main__":
    print(prepare_home(sys.argv[1] if len(sys.argv) > 1 else None))
