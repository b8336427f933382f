"""The run folder's count of worker-group starts, which `restarts` is taken from."""

from __future__ import annotations

import pytest

from training_core.train.checkpointing import (
    WORKER_GROUP_STARTS,
    TrainingProgress,
    record_worker_group_start,
    restarts_on_resume,
)


def test_each_start_adds_one_line_and_returns_the_count_so_far(tmp_path):
    run_directory = tmp_path / "ray" / "run"  # not there yet: the first start creates it
    assert [record_worker_group_start(run_directory) for _ in range(3)] == [1, 2, 3]
    assert len((run_directory / WORKER_GROUP_STARTS).read_text().splitlines()) == 3


def test_a_run_in_another_folder_counts_from_one(tmp_path):
    record_worker_group_start(tmp_path / "first")
    assert record_worker_group_start(tmp_path / "second") == 1


@pytest.mark.parametrize(("checkpointed", "earlier_starts", "restarts"), [
    (None, 0, 0),                                       # a first start
    (None, 1, 1),                                       # killed before the first checkpoint
    (TrainingProgress(step=3), 1, 1),                   # killed after it: resumed once
    (TrainingProgress(step=3), 2, 2),                   # killed twice after the same checkpoint
    (TrainingProgress(step=3, restarts=1), 0, 2),       # a checkpoint from before starts were recorded
    (TrainingProgress(step=8, restarts=1, finished=True), 3, 1),  # a finished run relaunched trains nothing
])
def test_restarts_count_every_start_after_the_first_whatever_the_checkpoints_say(checkpointed, earlier_starts,
                                                                                  restarts):
    assert restarts_on_resume(checkpointed, earlier_starts) == restarts
