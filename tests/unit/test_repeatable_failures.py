"""The record that stops Ray Train's retries of a failure every attempt would repeat."""

from __future__ import annotations

import pytest

from training_core.data.reader import ReaderStateError
from training_core.errors import SourceDataError, TrainingDivergedError
from training_core.train.repeatable_failures import (
    EarlierAttemptFailed,
    clear_repeatable_failure,
    record_repeatable_failure,
    recorded_repeatable_failure,
    stop_if_an_earlier_attempt_failed,
)


def test_the_first_recorded_error_is_raised_again_with_its_own_type(tmp_path):
    assert recorded_repeatable_failure(tmp_path) is None
    stop_if_an_earlier_attempt_failed(tmp_path)  # nothing recorded: the attempt goes on

    record_repeatable_failure(tmp_path, 1, SourceDataError("d/part-0.parquet: column 'labels' is ragged"))
    record_repeatable_failure(tmp_path, 0, ReaderStateError("another error, from another rank"))
    rebuilt = recorded_repeatable_failure(tmp_path)
    assert type(rebuilt) is SourceDataError
    assert str(rebuilt).startswith("d/part-0.parquet: column 'labels' is ragged (on training rank 1;")
    with pytest.raises(EarlierAttemptFailed, match=r"failed on rank 1 with SourceDataError: d/part-0\.parquet"):
        stop_if_an_earlier_attempt_failed(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["repeatable-failure.json"]  # no temporary left

    clear_repeatable_failure(tmp_path)
    assert recorded_repeatable_failure(tmp_path) is None
    clear_repeatable_failure(tmp_path)  # nothing to clear is fine


def test_a_torn_record_or_no_storage_folder_stops_nothing(tmp_path):
    (tmp_path / "repeatable-failure.json").write_text('{"type": "SourceData')
    stop_if_an_earlier_attempt_failed(tmp_path)
    assert recorded_repeatable_failure(tmp_path) is None
    record_repeatable_failure(None, 0, SourceDataError("no run folder: nothing to record in"))
    stop_if_an_earlier_attempt_failed(None)


def test_a_diverged_runs_curve_comes_back_with_its_error(tmp_path):
    record_repeatable_failure(tmp_path, 0, TrainingDivergedError("training diverged: nan at step 4",
                                                                 loss_history=[(1, 3.4), (2, 3.1), (3, 2.9)]))
    rebuilt = recorded_repeatable_failure(tmp_path)
    assert type(rebuilt) is TrainingDivergedError and rebuilt.loss_history == [(1, 3.4), (2, 3.1), (3, 2.9)]
