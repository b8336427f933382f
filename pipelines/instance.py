"""The local Dagster instance under $TESSERA_HOME/dagster: telemetry off, training pool of 1."""

import contextlib
import logging
import os
import sys
import threading
import uuid
from pathlib import Path

from assets.run_identity import LAUNCHER_TAG, inherited_launcher_tag  # LAUNCHER_TAG re-exported: `tessera demo` sets it
from training_core.errors import ConfigError, TesseraError

log = logging.getLogger(__name__)

INSTANCE_SETTINGS = """\
telemetry:
  enabled: false
nux:
  enabled: false
run_monitoring:
  # The daemon fails runs stuck STARTING or CANCELING; the code server, runs it launched whose process died.
  enabled: true
  # ... but such a run keeps its training pool slot (and a run canceled while waiting, its place in the queue)
  # unless the daemon frees what ended runs still hold.
  free_slots_after_run_end_seconds: 30
concurrency:
  pools:
    # Only lora_adapter uses a pool ("training"): at most this many trainings at once.
    default_limit: 1
python_logs:
  # training_core's INFO lines (the MLflow run a step started or reused, checkpoints removed) in the run's log.
  managed_python_loggers:
    - training_core
  python_log_level: INFO
"""


def prepare_home(home: str | None = None) -> Path:
    """Create the state root and DAGSTER_HOME, and export both for this process."""
    from resources.paths import check_not_moved, refuse_read_only_state, state_root

    root = state_root(home)
    dagster_home = root / "dagster"
    # Dagster's and MLflow's SQLite stores there name neither the folder nor the cause when it is read-only
    refuse_read_only_state(root, root, dagster_home, root / "mlflow.db")
    try:
        dagster_home.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file in the way, no permission, a read-only disk
        raise ConfigError(f"state folder {root} is not usable: {error.strerror or error}") from error
    check_not_moved(root)
    settings = dagster_home / "dagster.yaml"
    if _needs_settings(settings):
        _write_settings(settings)
    os.environ["TESSERA_HOME"] = str(root)
    os.environ["DAGSTER_HOME"] = str(dagster_home)
    return root


def _needs_settings(settings: Path) -> bool:
    """Missing, or empty: what a write killed (or a machine losing power) before the atomic write
    existed left, which Dagster loads silently with no pool limit. Any other file is the operator's
    and kept as it is (a damaged one is named by `load_instance`)."""
    try:
        current = settings.read_bytes()
    except FileNotFoundError:
        return True
    except OSError:
        return False  # unreadable: `load_instance` names it
    if current.strip():
        return False
    log.warning("%s is empty (an interrupted write): writing tessera's settings again", settings)
    return True


def _write_settings(settings: Path) -> None:
    """Through a temporary file and a rename, so a kill or a full disk never leaves a short file."""
    from training_core.storage import flush_file

    pending = settings.with_name(f"{settings.name}.{uuid.uuid4().hex}.tmp")
    try:
        pending.write_text(INSTANCE_SETTINGS)
        flush_file(pending)
        os.replace(pending, settings)
    except OSError as error:  # no permission, a full or read-only disk
        with contextlib.suppress(OSError):
            pending.unlink(missing_ok=True)
        raise ConfigError(f"cannot write {settings}: {error.strerror or error}") from error


def fail_abandoned_runs(instance) -> list[str]:
    """Runs started by a `tessera` process that no longer exists (killed mid-training) still hold
    their concurrency-pool slot; mark them failed and free the slot so a relaunch can proceed.
    (Under `dagster dev` the sensor `free_abandoned_runs` does this every minute.)"""
    import dagster as dg

    from training_core.process_identity import process_is_gone

    abandoned = []
    in_flight = dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING])
    for run in instance.get_runs(filters=in_flight):
        launcher = run.tags.get(LAUNCHER_TAG)
        # an inherited tag names the parent run's process: this run's own is unknown, so left alone
        if launcher is None or inherited_launcher_tag(instance, run) or not process_is_gone(launcher):
            continue
        # Read again: a run that ended by itself just before its process exited has its own status, and
        # Dagster would record FAILURE after its SUCCESS.
        if (current := instance.get_run_by_id(run.run_id)) is None or current.is_finished:
            continue
        instance.report_run_failed(current, f"launcher process {launcher} is gone; marked failed by tessera")
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        abandoned.append(run.run_id)
    return abandoned


def free_slots_of_ended_runs(instance) -> list[str]:
    """Runs that have ended but still hold a training pool slot, or a place in its queue: the code server
    marks a run it launched whose process was killed FAILURE without freeing its slot, and a run canceled
    while it waited keeps its place, to which the next freed slot is handed. Dagster's daemon frees them only
    where `run_monitoring.free_slots_after_run_end_seconds` is set, which instances made by earlier versions
    lack. Returns the runs whose slots were freed."""
    import dagster as dg

    holding = instance.event_log_storage.get_concurrency_run_ids()
    if not holding:
        return []
    ended_statuses = [dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED]
    ended = instance.get_runs(filters=dg.RunsFilter(run_ids=sorted(holding), statuses=ended_statuses))
    for run in ended:
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
    return [run.run_id for run in ended]


def free_training_pool(instance) -> tuple[list[str], list[str]]:
    """Both ways a training pool slot outlives its run, swept in this order: runs whose launcher process is
    gone are marked failed (which frees their slots), then the slots that ended runs still hold are freed.
    Returns (runs marked failed, ended runs whose slots were freed); every launcher and the sensor call this."""
    return fail_abandoned_runs(instance), free_slots_of_ended_runs(instance)


class AbandonedRunWatch:
    """While a launcher's own run executes (and may wait for the training pool's slot), frees every
    few seconds the slots of runs whose process was killed meanwhile. Without it, a `tessera demo`
    waiting behind a demo that was killed waited for ever: the slot was freed only by the next
    launch. ``on_freed(failed, released)`` gets what each sweep freed, as :func:`free_training_pool`
    returns it, when it freed anything."""

    def __init__(self, instance, on_freed, interval_s: float = 5.0) -> None:
        self._instance, self._on_freed = instance, on_freed
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tessera-abandoned-run-watch", daemon=True)

    def __enter__(self) -> "AbandonedRunWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _watch(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                failed, released = free_training_pool(self._instance)
                if failed or released:
                    self._on_freed(failed, released)
            except Exception as error:  # noqa: BLE001 - a storage hiccup must not end the launcher's run
                log.warning("checking for abandoned runs failed (%s: %s); trying again", type(error).__name__, error)


def load_instance():
    """The Dagster instance of the prepared state folder ($DAGSTER_HOME). A damaged dagster.yaml is
    named in one line: Dagster fails on it with a YAML, config or even a TypeError traceback."""
    import dagster as dg
    import yaml

    settings = Path(os.environ["DAGSTER_HOME"]) / "dagster.yaml"
    try:
        return dg.DagsterInstance.get()
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{settings}: not valid YAML{where} ({problem}); fix it, or delete it and "
                          "tessera writes its default") from error
    except dg.DagsterInvalidConfigError as error:
        reason = "; ".join(" ".join(e.message.split()) for e in error.errors)
        raise ConfigError(f"{settings}: not a valid Dagster instance config ({reason}); fix it, or delete it "
                          "and tessera writes its default") from error
    except Exception as error:  # noqa: BLE001 - Dagster fails on some bad values with a bare TypeError
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ConfigError(f"cannot load the Dagster instance in {settings.parent}: {type(error).__name__}"
                          f"{': ' + reason if reason else ''}; check {settings}, or delete it and tessera "
                          "writes its default") from error


USAGE = """usage: python -m pipelines.instance [STATE_FOLDER]

Create the state folder (default: $TESSERA_HOME, else .tessera/) and its Dagster instance settings,
check that Dagster can load them, and print the folder's absolute path (`make ui` uses it)."""


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if arguments and arguments[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0)
    if len(arguments) > 1 or (arguments and arguments[0].startswith("-")):  # never a folder named "--x"
        print(f"python -m pipelines.instance: unexpected arguments {arguments}\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    try:
        root = prepare_home(arguments[0] if arguments else None)
        load_instance()  # a damaged dagster.yaml is named here, not by `dagster dev` later
    except TesseraError as error:  # a file where the folder should be, no permission: one line, not a traceback
        print(f"python -m pipelines.instance: {error}", file=sys.stderr)
        sys.exit(2)
    print(root)
