"""What checkpoints leave behind: a worker's staging folder in $TMPDIR when it is killed while
checkpointing, and a run's checkpoint folders that Ray's checkpoint list lost track of."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.unit.test_checkpointing import _checkpoint
from training_core.train.checkpoint_staging import (
    STAGING_PREFIX,
    checkpoint_staging_directory,
    remove_abandoned_checkpoint_staging,
)
from training_core.train.checkpointing import RAY_SNAPSHOT, find_latest_checkpoint, set_aside_unusable_ray_snapshot

KILLED_WHILE_STAGING = """
import os, signal
from training_core.train.checkpoint_staging import checkpoint_staging_directory
with checkpoint_staging_directory() as staging:
    (staging / "worker-0.pt").write_bytes(b"optimizer state" * 1000)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_worker_killed_while_staging_a_checkpoint_leaves_it_until_the_next_worker_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the temporary folder of this "host"
    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_STAGING], env={**os.environ, "TMPDIR": str(tmp_path)},
                            capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    [left_behind] = tmp_path.glob(f"{STAGING_PREFIX}*")
    assert (left_behind / "worker-0.pt").is_file()

    host = socket.gethostname()
    reused_pid = tmp_path / f"{STAGING_PREFIX}{host}-{os.getpid()}-1.000-abcd1234"  # our PID, another start time
    other_host = tmp_path / f"{STAGING_PREFIX}another-host-1-1.000-abcd1234"  # a shared temporary folder
    before_names = tmp_path / f"{STAGING_PREFIX}k2j4h5l1"  # an older Tessera's name: whose, nobody can tell
    for folder in (reused_pid, other_host, before_names):
        folder.mkdir()
    with checkpoint_staging_directory() as live:  # this worker's own, mid-checkpoint
        assert live.parent == tmp_path and live.name.startswith(f"{STAGING_PREFIX}{host}-{os.getpid()}-")
        removed = remove_abandoned_checkpoint_staging()
        assert sorted(removed) == sorted([left_behind, reused_pid])
        assert live.is_dir() and other_host.is_dir() and before_names.is_dir()
    assert not live.exists()
    assert sorted(tmp_path.iterdir()) == sorted([other_host, before_names])


def _ray_list(run_directory, *names, latest=None):
    results = [{"checkpoint_dir_name": name} for name in names]
    (run_directory / RAY_SNAPSHOT).write_text(json.dumps({
        "ray_version": "2.60.0", "checkpoint_results": results,
        "latest_checkpoint_result": {"checkpoint_dir_name": latest or names[-1]}}))


def test_checkpoints_of_a_set_aside_ray_list_are_removed_once_the_run_has_finished(tmp_path):
    from training_core.train.launcher import publish_final_checkpoint

    run = tmp_path / "ray" / "train-run"
    # The first attempt's two checkpoints, then its list was damaged and set aside on the relaunch.
    first = [_checkpoint(run, f"checkpoint_00000{i}", step=10 * i, world_size=2) for i in (1, 2)]
    (run / RAY_SNAPSHOT).write_text('{"ray_version": "2.6')
    assert set_aside_unusable_ray_snapshot(run, "2.60.0") is not None
    assert find_latest_checkpoint(run) == first[1]  # what the relaunch resumes from
    # The relaunch's own checkpoints, in the list Ray wrote afresh; one a killed worker uploaded unregistered.
    unregistered = _checkpoint(run, "checkpoint_000003", step=30, world_size=2)
    periodic = _checkpoint(run, "checkpoint_000004", step=40, world_size=2)
    final = _checkpoint(run, "checkpoint_000005", step=50, world_size=2, model=True)
    _ray_list(run, periodic.name, final.name)
    not_ours = run / "checkpoint_tmp"
    not_ours.mkdir()
    (not_ours / "data.bin").write_bytes(b"x")

    publish_final_checkpoint(final, run, tmp_path / "trained" / "train-run")
    assert sorted(p.name for p in run.glob("checkpoint_*") if p.is_dir()) == [periodic.name, final.name, not_ours.name]
    assert not unregistered.exists() and not any(p.exists() for p in first)


def test_nothing_is_removed_when_rays_list_cannot_say_what_it_keeps(tmp_path):
    from training_core.train.launcher import publish_final_checkpoint

    run = tmp_path / "ray" / "train-run"
    orphan = _checkpoint(run, "checkpoint_000001", step=10, world_size=1)
    final = _checkpoint(run, "checkpoint_000002", step=20, world_size=1, model=True)
    for damaged_list in ('{"ray_version": "2.6', json.dumps({"checkpoint_results": [{"checkpoint_dir_name": "x"}]})):
        (run / RAY_SNAPSHOT).write_text(damaged_list)  # unreadable, or it does not name the final checkpoint
        publish_final_checkpoint(final, run, tmp_path / "trained" / "train-run")
        assert orphan.is_dir() and final.is_dir()


def test_the_training_loop_stages_each_checkpoint_under_its_process_name(tmp_path, monkeypatch):
    import ray.train

    from tests.unit.test_checkpointing import LOADER_STATE, RecordingEngine
    from training_core.train.checkpointing import TrainingProgress
    from training_core.train.loop import _report

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    reported = []  # Ray copies the folder to the run's storage inside report(); here we only look at it
    monkeypatch.setattr(ray.train, "report", lambda metrics, checkpoint: reported.append(
        (checkpoint.path, sorted(p.name for p in Path(checkpoint.path).iterdir()))))
    _report(RecordingEngine(), 0, TrainingProgress(step=5), LOADER_STATE)
    [(staged, files)] = reported
    assert Path(staged).parent == tmp_path
    assert Path(staged).name.startswith(f"{STAGING_PREFIX}{socket.gethostname()}-{os.getpid()}-")
    assert files == ["files-0.json", "progress.json", "worker-0.pt"] and not Path(staged).exists()
