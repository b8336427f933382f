"""The run folder's count of worker-group starts, which `restarts` is taken from."""

from __future__ import annotations

from training_core.train.checkpointing import WORKER_GROUP_STARTS, record_worker_group_start


def test_each_start_adds_one_line_and_returns_the_count_so_far(tmp_path):
    run_directory = tmp_path / "ray" / "run"  # not there yet: the first start creates it
    assert [record_worker_group_start(run_directory) for _ in range(3)] == [1, 2, 3]
    assert len((run_directory / WORKER_GROUP_STARTS).read_text().splitlines()) == 3


def test_a_run_in_another_folder_counts_from_one(tmp_path):
    record_worker_group_start(tmp_path / "first")
    assert record_worker_group_start(tmp_path / "second") == 1
