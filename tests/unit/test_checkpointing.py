"""Checkpoint folders without DeepSpeed: which ones may be resumed, and what a resume restores.

The engine is a recorder of the calls made to it: this tests our own resume logic; real DeepSpeed
checkpoints are exercised in tests/integration/test_training_runs.py."""

from __future__ import annotations

import json
import random
import re
import shutil

import pytest

from training_core.train.checkpointing import (
    ENGINE_DIR,
    MODEL_DIR,
    TrainingProgress,
    find_latest_checkpoint,
    load_progress,
    record_run_settings,
    restore_checkpoint,
    save_checkpoint,
    seal_checkpoint,
    verify_checkpoint_files,
)
from training_core.train.config import LoraSettings, TrainingConfig


class RecordingEngine:
    def __init__(self) -> None:
        self.saved: list[str] = []
        self.loaded: list[str] = []

    def save_checkpoint(self, directory: str, tag: str, exclude_frozen_parameters: bool = False) -> None:
        self.saved.append(directory)

    def load_checkpoint(self, directory: str, tag: str, load_module_strict: bool) -> None:
        self.loaded.append(directory)


LOADER_STATE = {"format": 1, "epoch": 1, "samples_in_epoch": 64}


def test_final_checkpoint_is_written_without_engine_state_and_restores_progress(tmp_path):
    engine = RecordingEngine()
    save_checkpoint(tmp_path, engine, 0, TrainingProgress(step=30, finished=True), LOADER_STATE, engine_state=False)
    assert engine.saved == [] and not (tmp_path / ENGINE_DIR).exists()

    progress, loader_state = restore_checkpoint(tmp_path, engine, 0)
    assert engine.loaded == []  # nothing to load: the caller takes the model from model/
    assert (progress.step, progress.finished, loader_state) == (30, True, LOADER_STATE)


def test_unfinished_checkpoint_without_engine_state_is_refused_by_name(tmp_path):
    save_checkpoint(tmp_path, RecordingEngine(), 0, TrainingProgress(step=20), LOADER_STATE, engine_state=False)
    with pytest.raises(RuntimeError, match=rf"{re.escape(str(tmp_path))}.*step 20.*no {ENGINE_DIR}/ engine state"):
        restore_checkpoint(tmp_path, RecordingEngine(), 0)


def test_periodic_checkpoint_restores_the_engine_and_this_ranks_rng(tmp_path):
    engine = RecordingEngine()
    random.seed(7)
    save_checkpoint(tmp_path, engine, 0, TrainingProgress(step=10), LOADER_STATE)
    (tmp_path / ENGINE_DIR).mkdir()  # what DeepSpeed's save_checkpoint creates
    expected = random.random()
    random.seed(99)
    restore_checkpoint(tmp_path, engine, 0)
    assert engine.saved == [str(tmp_path / ENGINE_DIR)] and engine.loaded == [str(tmp_path / ENGINE_DIR)]
    assert random.random() == expected


def _checkpoint(run_directory, name: str, step: int, world_size: int, *, model: bool = False,
                settings: tuple | None = None):
    """A checkpoint folder as Ray merges it: every rank's files, each rank's manifest last. A
    final one (``model``) holds the model and no engine state, as the training loop writes it.
    ``settings``: (config, base model, training folders) the run was started with, or None for a
    checkpoint written before they were recorded."""
    folder = run_directory / name
    for rank in range(world_size):
        folder.mkdir(parents=True, exist_ok=True)
        if not model:
            (folder / ENGINE_DIR).mkdir(exist_ok=True)
            (folder / ENGINE_DIR / f"shard-{rank}.pt").write_bytes(bytes(range(256)) * (rank + 1))
        progress = TrainingProgress(step=step, world_size=world_size, finished=model)
        if settings is not None:
            record_run_settings(progress, *settings)
        save_checkpoint(folder, RecordingEngine(), rank, progress, LOADER_STATE, engine_state=False)
        if model and rank == 0:
            (folder / MODEL_DIR).mkdir()
            (folder / MODEL_DIR / "adapter_model.safetensors").write_bytes(b"weights" * 100)
        seal_checkpoint(folder, rank)
    return folder


def test_a_checkpoint_with_a_truncated_or_missing_file_is_not_resumed_from(tmp_path):
    older = _checkpoint(tmp_path, "checkpoint_000001", step=10, world_size=2)
    newest = _checkpoint(tmp_path, "checkpoint_000002", step=20, world_size=2)
    assert find_latest_checkpoint(tmp_path) == newest

    shard = newest / ENGINE_DIR / "shard-1.pt"  # rank 1 killed while Ray uploaded its shard
    shard.write_bytes(shard.read_bytes()[:100])
    assert verify_checkpoint_files(newest, world_size=2) == [f"{ENGINE_DIR}/shard-1.pt (truncated or resized)"]
    assert find_latest_checkpoint(tmp_path) == older

    (older / "files-1.json").unlink()  # rank 1 died before sealing
    assert verify_checkpoint_files(older, world_size=2) == ["files-1.json (missing or unreadable)"]
    assert find_latest_checkpoint(tmp_path) is None


@pytest.mark.parametrize("lost", ["files-0.json", "progress.json"])
def test_a_final_checkpoint_missing_a_manifest_or_its_world_size_is_not_trusted(tmp_path, lost):
    from training_core.train.launcher import publish_model

    # Rank 0 wrote the model and progress.json: with its manifest lost, rank 1's lists none of
    # them, and a check of the manifests present alone found nothing wrong.
    final = _checkpoint(tmp_path / "ray", "checkpoint_000003", step=30, world_size=2, model=True)
    (final / lost).unlink()
    problem = f"{lost} (missing or unreadable)"
    assert problem in verify_checkpoint_files(final, only=MODEL_DIR)
    assert problem in verify_checkpoint_files(final)
    target = tmp_path / "trained" / "train-run"
    with pytest.raises(RuntimeError, match=rf"{re.escape(str(final))} is damaged or incomplete.*{re.escape(problem)}"):
        publish_model(final, target)
    assert not target.exists()


def test_model_files_are_checked_byte_for_byte_against_the_manifest(tmp_path):
    final = _checkpoint(tmp_path, "checkpoint_000003", step=30, world_size=1, model=True)
    assert verify_checkpoint_files(final, only=MODEL_DIR) == []
    weights = final / MODEL_DIR / "adapter_model.safetensors"
    weights.write_bytes(b"WEIGHTS" * 100)  # same size, other bytes
    assert verify_checkpoint_files(final, only=MODEL_DIR) == [f"{MODEL_DIR}/adapter_model.safetensors (changed)"]
    assert verify_checkpoint_files(final, only=MODEL_DIR, check_digests=False) == []


def test_the_final_model_is_published_whole_and_replaces_an_earlier_attempt(tmp_path):
    from training_core.storage import changed_files
    from training_core.train.launcher import publish_model

    final = _checkpoint(tmp_path / "ray", "checkpoint_000003", step=30, world_size=1, model=True)
    target = tmp_path / "trained" / "train-run"
    target.mkdir(parents=True)
    (target / "adapter_model.safetensors").write_bytes(b"half-cop")  # an earlier, killed copy
    assert publish_model(final, target) == target
    assert (target / "adapter_model.safetensors").read_bytes() == b"weights" * 100
    assert changed_files(target) == []  # digests recorded: a later reuse can check the folder
    assert [p.name for p in target.parent.iterdir()] == ["train-run"]  # no staging left behind

    (final / MODEL_DIR / "adapter_model.safetensors").write_bytes(b"weights" * 50)
    with pytest.raises(RuntimeError, match=r"not published: model/adapter_model.safetensors \(truncated"):
        publish_model(final, target)
    assert (target / "adapter_model.safetensors").read_bytes() == b"weights" * 100  # left as it was


@pytest.mark.parametrize("damage", ["garbled", "other_ray", "folder_gone", "file_truncated"])
def test_a_ray_checkpoint_list_ray_would_refuse_or_trust_wrongly_is_set_aside(tmp_path, damage):
    from training_core.train.checkpointing import RAY_SNAPSHOT, set_aside_unusable_ray_snapshot

    older = _checkpoint(tmp_path, "checkpoint_000001", step=10, world_size=1)
    newest = _checkpoint(tmp_path, "checkpoint_000002", step=20, world_size=1)
    snapshot = {"ray_version": "2.60.0", "checkpoint_results": [{"checkpoint_dir_name": p.name} for p in (older, newest)]}
    (tmp_path / RAY_SNAPSHOT).write_text(json.dumps(snapshot))
    assert set_aside_unusable_ray_snapshot(tmp_path, "2.60.0") is None and (tmp_path / RAY_SNAPSHOT).exists()

    expected = {"garbled": "unreadable", "other_ray": "written by Ray 2.60.0, this is Ray 2.61.0",
                "folder_gone": "gone: checkpoint_000002", "file_truncated": "damaged checkpoint"}[damage]
    if damage == "garbled":
        (tmp_path / RAY_SNAPSHOT).write_text('{"ray_version": "2.6')  # cut off mid-write
    elif damage == "folder_gone":
        shutil.rmtree(newest)
    elif damage == "file_truncated":
        (newest / ENGINE_DIR / "shard-0.pt").write_bytes(b"")
    reason = set_aside_unusable_ray_snapshot(tmp_path, "2.61.0" if damage == "other_ray" else "2.60.0")
    assert reason is not None and expected in reason
    assert not (tmp_path / RAY_SNAPSHOT).exists() and len(list(tmp_path.glob(f"{RAY_SNAPSHOT}.unusable-*"))) == 1
    assert find_latest_checkpoint(tmp_path) == (newest if damage in ("garbled", "other_ray") else older)


def _finished_run(run_directory, world_size: int = 2):
    """The two checkpoints Ray keeps of a finished run: a periodic one and the final one."""
    periodic = _checkpoint(run_directory, "checkpoint_000002", step=20, world_size=world_size)
    final = _checkpoint(run_directory, "checkpoint_000003", step=30, world_size=world_size, model=True)
    return periodic, final


def test_publishing_drops_the_engine_state_of_earlier_checkpoints_only(tmp_path):
    from training_core.train.checkpointing import RAY_SNAPSHOT, set_aside_unusable_ray_snapshot
    from training_core.train.launcher import publish_final_checkpoint

    run = tmp_path / "ray" / "train-run"
    periodic, final = _finished_run(run)
    not_ours = run / "checkpoint_tmp"  # no progress.json: nothing says it is a checkpoint of ours
    (not_ours / ENGINE_DIR).mkdir(parents=True)
    (not_ours / ENGINE_DIR / "state.pt").write_bytes(b"x")
    (run / RAY_SNAPSHOT).write_text(json.dumps(
        {"ray_version": "2.60.0", "checkpoint_results": [{"checkpoint_dir_name": p.name} for p in (periodic, final)]}))
    final_files = sorted(p.relative_to(final) for p in final.rglob("*"))

    target = tmp_path / "trained" / "train-run"
    assert publish_final_checkpoint(final, run, target) == target
    assert (target / "adapter_model.safetensors").is_file()
    assert not (periodic / ENGINE_DIR).exists()
    assert (periodic / "progress.json").is_file() and (periodic / "worker-1.pt").is_file()
    assert sorted(p.relative_to(final) for p in final.rglob("*")) == final_files
    assert (not_ours / ENGINE_DIR / "state.pt").read_bytes() == b"x"
    # The manifests now describe what is left: the folder verifies, so Ray's list naming it is kept
    # on a relaunch, and the relaunch takes the finished checkpoint.
    assert verify_checkpoint_files(periodic) == [] and verify_checkpoint_files(final) == []
    assert set_aside_unusable_ray_snapshot(run, "2.60.0") is None
    assert find_latest_checkpoint(run) == final
    # Never resumed from, even when the final checkpoint is gone: it holds nothing to resume.
    shutil.rmtree(final)
    assert find_latest_checkpoint(run) is None


def test_engine_state_is_kept_when_the_model_is_not_published(tmp_path):
    from training_core.train.launcher import publish_final_checkpoint

    run = tmp_path / "ray" / "train-run"
    periodic, final = _finished_run(run)
    (final / MODEL_DIR / "adapter_model.safetensors").write_bytes(b"weights" * 50)  # upload cut short
    with pytest.raises(RuntimeError, match=r"not published"):
        publish_final_checkpoint(final, run, tmp_path / "trained" / "train-run")
    assert sorted(p.name for p in (periodic / ENGINE_DIR).iterdir()) == ["shard-0.pt", "shard-1.pt"]
    assert find_latest_checkpoint(run) == periodic  # a relaunch resumes from it


def test_a_periodic_checkpoint_at_the_final_step_loses_its_engine_state_too(tmp_path):
    from training_core.train.checkpointing import drop_engine_state_of_earlier_checkpoints

    # max_epochs ended the run right after the periodic checkpoint of step 20: the final one shares its step.
    run = tmp_path / "ray" / "train-run"
    periodic = _checkpoint(run, "checkpoint_000001", step=20, world_size=1)
    final = _checkpoint(run, "checkpoint_000002", step=20, world_size=1, model=True)
    assert drop_engine_state_of_earlier_checkpoints(run, final) == [periodic]
    assert not (periodic / ENGINE_DIR).exists() and verify_checkpoint_files(periodic) == []
    assert find_latest_checkpoint(run) == final


@pytest.mark.parametrize("final_is", ["unfinished", "in_another_folder"])
def test_engine_state_is_dropped_only_next_to_a_finished_checkpoint(tmp_path, final_is):
    from training_core.train.checkpointing import drop_engine_state_of_earlier_checkpoints

    run = tmp_path / "ray" / "train-run"
    older = _checkpoint(run, "checkpoint_000001", step=10, world_size=1)
    if final_is == "unfinished":
        final = _checkpoint(run, "checkpoint_000002", step=20, world_size=1)
    else:
        final = _checkpoint(tmp_path / "download", "checkpoint_000002", step=20, world_size=1, model=True)
    assert drop_engine_state_of_earlier_checkpoints(run, final) == []
    assert (older / ENGINE_DIR / "shard-0.pt").is_file() and verify_checkpoint_files(older) == []


def _ray_list(run_directory, *checkpoints, latest):
    """Ray's checkpoint list as Ray 2.60 writes it: ``latest`` is the one it hands the workers."""
    from training_core.train.checkpointing import RAY_SNAPSHOT

    def entry(folder):
        return {"version": 0, "checkpoint_dir_name": folder.name, "metrics": {}}

    (run_directory / RAY_SNAPSHOT).write_text(json.dumps({
        "ray_version": "2.60.0", "checkpoint_results": [entry(c) for c in checkpoints],
        "checkpoint_report_indices": list(range(len(checkpoints))), "latest_checkpoint_result": entry(latest)}))


def test_resuming_an_unfinished_zero_run_at_another_world_size_is_refused_before_any_worker_starts(tmp_path):
    from training_core.errors import ConfigError
    from training_core.train.config import TrainingConfig
    from training_core.train.launcher import check_relaunch_world_size, relaunch_point

    run = tmp_path / "ray" / "train-run"
    _checkpoint(run, "checkpoint_000001", step=3, world_size=1)
    _checkpoint(run, "checkpoint_000002", step=6, world_size=1)
    with pytest.raises(ConfigError, match=rf"^run folder {re.escape(str(run))} holds an unfinished run \(checkpoint "
                       r"checkpoint_000002, step 6\) trained by 1 worker\(s\); num_workers=2 cannot resume it: ZeRO "
                       r"stage 2 .*Relaunch with num_workers=1 to finish it, or use a new run_name to start over$"):
        check_relaunch_world_size(TrainingConfig(num_workers=2, zero_stage=2), run, relaunch_point(run))
    resumed = relaunch_point(run)
    check_relaunch_world_size(TrainingConfig(num_workers=1, zero_stage=2), run, resumed)  # the same world resumes
    check_relaunch_world_size(TrainingConfig(num_workers=2, zero_stage=0), run, resumed)  # ZeRO-0 is not partitioned
    new_run = tmp_path / "ray" / "new-run"
    assert relaunch_point(new_run) is None
    check_relaunch_world_size(TrainingConfig(num_workers=2), new_run, relaunch_point(new_run))  # nothing to resume


def test_a_finished_run_is_relaunched_at_any_world_size(tmp_path):
    from training_core.train.config import TrainingConfig
    from training_core.train.launcher import check_relaunch_world_size, relaunch_point

    run = tmp_path / "ray" / "train-run"
    periodic, final = _finished_run(run, world_size=1)  # the periodic one still holds its engine state
    _ray_list(run, periodic, final, latest=final)
    for workers in (1, 2, 3):
        check_relaunch_world_size(TrainingConfig(num_workers=workers, zero_stage=3), run, relaunch_point(run))


def test_the_world_size_check_reads_the_checkpoint_ray_hands_the_workers(tmp_path):
    from training_core.errors import ConfigError
    from training_core.train.checkpointing import checkpoint_a_relaunch_resumes_from
    from training_core.train.config import TrainingConfig
    from training_core.train.launcher import check_relaunch_world_size, relaunch_point

    # A worker finished the run but died before Ray registered the final checkpoint: Ray still
    # hands the workers the periodic one, and resuming it at 2 workers fails in DeepSpeed.
    run = tmp_path / "ray" / "train-run"
    periodic, final = _finished_run(run, world_size=1)
    _ray_list(run, periodic, latest=periodic)
    assert find_latest_checkpoint(run) == final and checkpoint_a_relaunch_resumes_from(run) == periodic
    with pytest.raises(ConfigError, match=r"checkpoint checkpoint_000002, step 20\) trained by 1 worker"):
        check_relaunch_world_size(TrainingConfig(num_workers=2), run, relaunch_point(run))


STARTED_WITH = TrainingConfig(num_workers=1, max_steps=4, learning_rate=5e-2)


@pytest.mark.parametrize("finished", [False, True], ids=["unfinished", "finished"])
@pytest.mark.parametrize(("relaunch", "changes"), [
    ({"config": STARTED_WITH.model_copy(update={"max_steps": 8, "learning_rate": 1e-3})},
     r"learning_rate: 0\.05 → 0\.001; max_steps: 4 → 8"),
    ({"config": STARTED_WITH.model_copy(update={"lora": LoraSettings(r=8, target_modules=["q_proj"])})},
     r"lora\.r: 16 → 8; lora\.target_modules: 'all-linear' → \['q_proj'\]"),
    ({"config": STARTED_WITH.model_copy(update={"method": "full"})}, r"method: 'lora' → 'full'"),
    ({"base_model": "/models/other"}, r"base model: /models/base → /models/other"),
    ({"train_dirs": ["/data/day-1/train", "/data/day-2/train"]},
     r"training data: /data/day-1/train → /data/day-1/train, /data/day-2/train"),
], ids=["schedule", "lora", "method", "base_model", "data"])
def test_a_relaunch_with_other_settings_is_refused_before_any_worker_starts(tmp_path, finished, relaunch, changes):
    from training_core.errors import ConfigError
    from training_core.train.launcher import check_relaunch_settings, relaunch_point

    run = tmp_path / "ray" / "train-run"
    started = (STARTED_WITH, "/models/base", ["/data/day-1/train"])
    _checkpoint(run, "checkpoint_000001", step=2, world_size=1, settings=started)
    if finished:
        _checkpoint(run, "checkpoint_000002", step=4, world_size=1, model=True, settings=started)
    wanted = {"config": STARTED_WITH, "base_model": "/models/base", "train_dirs": ["/data/day-1/train"], **relaunch}
    state, step = ("a finished run", 4) if finished else ("an unfinished run", 2)
    with pytest.raises(ConfigError, match=rf"^run folder {re.escape(str(run))} holds {state} \(checkpoint "
                       rf"checkpoint_00000{step // 2}, step {step}\) started with other settings: {changes}\. Use "
                       rf"another run_name, or remove {re.escape(str(run))} to start afresh$"):
        check_relaunch_settings(wanted["config"], run, relaunch_point(run), wanted["base_model"], wanted["train_dirs"])


def test_a_relaunch_may_change_how_the_run_executes_and_old_checkpoints_are_accepted(tmp_path):
    from training_core.train.launcher import check_relaunch_settings, relaunch_point

    run = tmp_path / "ray" / "train-run"
    _checkpoint(run, "checkpoint_000001", step=2, world_size=1,
                settings=(STARTED_WITH, "/models/base", ["/data/day-1/train"]))
    check_relaunch_settings(STARTED_WITH, run, relaunch_point(run), "/models/base", ["/data/day-1/train"])
    # Settings of where and how fast it runs, not of what it trains (the world size has its own check).
    elsewhere = STARTED_WITH.model_copy(update={"num_workers": 2, "loader_workers": 3, "cpus_per_worker": 2})
    check_relaunch_settings(elsewhere, run, relaunch_point(run), "/models/base", ["/data/day-1/train"])
    new_run = tmp_path / "ray" / "new-run"
    check_relaunch_settings(TrainingConfig(learning_rate=1.0), new_run, relaunch_point(new_run), "/m", ["/d"])

    # Written before the settings were recorded: nothing to compare, so it resumes as it always did.
    old = tmp_path / "ray" / "old-run"
    _checkpoint(old, "checkpoint_000001", step=2, world_size=1)
    assert load_progress(old / "checkpoint_000001").config_digest is None
    check_relaunch_settings(TrainingConfig(learning_rate=1.0), old, relaunch_point(old), "/models/other",
                            ["/data/other"])


def test_a_relaunched_finished_run_is_reported_from_its_final_checkpoint_without_a_worker(tmp_path, monkeypatch):
    """No worker group starts for a run that finished (none could here: there is no model to load). A
    model whose bytes changed fails the relaunch at once, naming the checkpoint, not in every worker on every
    Ray retry. (A truncated one is no complete checkpoint: the run would train again from the start.)"""
    import training_core.train.launcher as launcher
    from training_core.train.fault_injection import FAULT_STEP_ENV
    from training_core.train.launcher import run_training
    from training_core.train.ray_trainer import HEALTH_CHECK_INTERVAL_ENV

    def no_worker_group():
        raise AssertionError("a Ray Train worker group was started for a finished run")

    monkeypatch.setattr(launcher, "torch_trainer_class", no_worker_group)
    monkeypatch.delenv(FAULT_STEP_ENV, raising=False)
    monkeypatch.setenv(HEALTH_CHECK_INTERVAL_ENV, "0.5")  # run_training sets it when unset: not for later tests
    config = TrainingConfig(max_steps=30, num_workers=2)
    final = _checkpoint(tmp_path / "ray" / "train-run", "checkpoint_000003", step=30, world_size=2, model=True,
                        settings=(config, "no-such-base-model", ["no-such-data"]))
    launch = dict(model_path="no-such-base-model", train_dirs=["no-such-data"], seq_len=64, cache_dir=None,
                  storage_path=tmp_path / "ray", run_name="train-run", output_dir=tmp_path / "trained",
                  checked_before_launch=True)

    result = run_training(config, **launch)
    assert (result.steps, result.restarts, result.model_dir) == (30, 0, str(tmp_path / "trained" / "train-run"))
    assert (tmp_path / "trained" / "train-run" / "adapter_model.safetensors").read_bytes() == b"weights" * 100
    assert sorted(path.name for path in final.parent.iterdir()) == ["checkpoint_000003"]

    (final / MODEL_DIR / "adapter_model.safetensors").write_bytes(b"WEIGHTS" * 100)  # same size, other bytes
    with pytest.raises(RuntimeError, match=rf"{re.escape(str(final))} is damaged or incomplete, its model is not "
                                           r"published: model/adapter_model.safetensors \(changed\)"):
        run_training(config, **launch)
