"""Failures that every attempt of a training run would repeat: bad data found mid-epoch, a loader
state that does not fit the data, a GPU setting on a node without one or without its package, a loss
that became NaN (the same seed diverges again).

Ray Train restarts the worker group after any worker error (``FailureConfig.max_failures``) and
has no way to say "this one is not worth retrying", so each retry would load the model and train
up to the same failure again. A worker that hits one of these errors records it in the run's
storage folder; the retries find the record and stop before loading anything, and the driver
raises the recorded error itself (its own type and message) instead of Ray's wrapper of the last
attempt."""

from __future__ import annotations

import json
import os
from pathlib import Path

from training_core.data.reader import ReaderStateError
from training_core.errors import (
    ConfigError,
    EmptyPartitionError,
    LineageError,
    ModelNotFoundError,
    SourceDataError,
    TesseraError,
    TrainingDivergedError,
)

RECORD_NAME = "repeatable-failure.json"

REPEATABLE_ERRORS: tuple[type[Exception], ...] = (TesseraError, ReaderStateError)
_BY_NAME = {kind.__name__: kind for kind in (
    TesseraError, SourceDataError, EmptyPartitionError, ConfigError, ModelNotFoundError, LineageError,
    TrainingDivergedError, ReaderStateError,
)}


class EarlierAttemptFailed(RuntimeError):
    """What a retried worker raises instead of training again."""


def _record_path(run_directory: str | Path) -> Path:
    return Path(run_directory) / RECORD_NAME


def record_repeatable_failure(run_directory: str | Path | None, rank: int, error: Exception) -> None:
    """Keep the first repeatable error of this run (a later rank's copy of it is not needed)."""
    if not run_directory:
        return
    path = _record_path(run_directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"type": type(error).__name__, "message": str(error), "rank": rank}
    if getattr(error, "loss_history", None):  # a diverged run's curve up to the failure, for its MLflow run
        record["loss_history"] = error.loss_history
    content = json.dumps(record)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(content)
    try:
        os.link(temporary, path)  # atomic and first-wins: a complete record or none
    except FileExistsError:
        pass
    finally:
        temporary.unlink()


def _read_record(run_directory: str | Path | None) -> dict | None:
    if not run_directory:
        return None
    try:
        record = json.loads(_record_path(run_directory).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return record if isinstance(record, dict) and "message" in record else None


def stop_if_an_earlier_attempt_failed(run_directory: str | Path | None) -> None:
    """Called first thing in a worker: a retry of an attempt that failed repeatably stops here."""
    if (record := _read_record(run_directory)) is not None:
        raise EarlierAttemptFailed(
            f"not retried: an earlier attempt of this run failed on rank {record.get('rank')} with "
            f"{record.get('type')}: {record['message']}"
        )


def clear_repeatable_failure(run_directory: str | Path) -> None:
    """Before a launch: a relaunch (after the data or the config was fixed) gets its own attempts."""
    _record_path(run_directory).unlink(missing_ok=True)


def recorded_repeatable_failure(run_directory: str | Path) -> Exception | None:
    """The recorded error, rebuilt with its own type, for the driver to raise; None if none."""
    if (record := _read_record(run_directory)) is None:
        return None
    kind = _BY_NAME.get(str(record.get("type")), TesseraError)
    error = kind(f"{record['message']} (on training rank {record.get('rank')}; Ray Train's retries stopped "
                 "before loading the model, since every attempt would fail the same way)")
    if isinstance(error, TrainingDivergedError):
        try:
            error.loss_history = [(int(step), float(loss)) for step, loss in record.get("loss_history") or []]
        except (TypeError, ValueError):
            pass  # a record this version did not write: the error without its curve
    return error
