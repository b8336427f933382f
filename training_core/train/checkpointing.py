"""Training checkpoints: DeepSpeed engine state (model, optimizer, scheduler) plus, per rank, the
RNG states and the loader position, plus the shared progress (step, loss curve, restarts).

Layout of one checkpoint directory (Ray Train merges every rank's files into it):
    deepspeed/            engine.save_checkpoint(tag=ENGINE_TAG); every rank writes its shard.
                          Not in the final checkpoint: a finished run resumes nothing, and for a
                          full fine-tune the optimizer state alone is several times the model.
                          Removed from the run's earlier checkpoints once the final model is
                          published (`drop_engine_state_of_earlier_checkpoints`).
    worker-<rank>.pt      python / numpy / torch RNG states and the reader's state_dict
    progress.json         written by rank 0
    model/                final checkpoint only: the adapter (LoRA) or full model, save_pretrained
    files-<rank>.json     written last by each rank: size and XXH3-128 of every file it wrote
                          (`seal_checkpoint`); a folder found on disk is trusted only when the
                          manifest of every rank of progress.json's world_size is there and
                          matches (Ray uploads ranks in parallel, and a worker killed mid-upload
                          leaves truncated files behind)
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from training_core.errors import ConfigError
from training_core.storage import file_digest
from training_core.train.config import TrainingConfig, dotted_settings

log = logging.getLogger(__name__)

ENGINE_TAG = "engine"
ENGINE_DIR = "deepspeed"
PROGRESS_FILE = "progress.json"
MODEL_DIR = "model"
MANIFEST_PREFIX = "files-"


@dataclass
class TrainingProgress:
    step: int = 0
    epoch: int = 0
    restarts: int = 0
    loss_history: list[tuple[int, float]] = field(default_factory=list)
    telemetry: dict = field(default_factory=dict)
    finished: bool = False
    world_size: int = 1
    # What the run trains, recorded when it starts (`record_run_settings`), so that a relaunch under
    # the same run name with other settings is refused (`settings_changed_since`) instead of resuming
    # or reporting this run; the digest is the lineage's config_digest. The base model and training
    # data as the launcher identified them (content digests on the tracked path, else their paths).
    # None in checkpoints written before they were recorded.
    config_digest: str | None = None
    config: dict | None = None
    base_model: str | None = None
    training_data: list[str] | None = None


# Settings that change how or where a run executes, not what it trains: a relaunch may change them.
# The world size is checked on its own: only ZeRO's partitioned engine state ties a run to it.
SETTINGS_A_RELAUNCH_MAY_CHANGE = frozenset({
    "num_workers", "cpus_per_worker", "loader_workers", "peak_flops_preset",
})


def record_run_settings(progress: TrainingProgress, config: TrainingConfig, base_model: str,
                        training_data: list[str]) -> None:
    progress.config_digest = config.digest()
    progress.config = config.model_dump(mode="json")
    progress.base_model = base_model
    progress.training_data = list(training_data)


def settings_changed_since(progress: TrainingProgress, config: TrainingConfig, base_model: str,
                           training_data: list[str]) -> list[str]:
    """How a relaunch's settings differ from those the checkpoint's run was started with
    ("learning_rate: 0.05 → 0.001", "base model: a → b"), [] when they do not. A checkpoint written
    before the settings were recorded carries none: it is accepted, as such relaunches always were."""
    changes = []
    if progress.config is not None and progress.config_digest != config.digest():
        recorded, wanted = _flat_settings(progress.config), _flat_settings(config.model_dump(mode="json"))
        for name in sorted(recorded.keys() | wanted.keys()):
            if name.split(".")[0] not in SETTINGS_A_RELAUNCH_MAY_CHANGE and recorded.get(name) != wanted.get(name):
                changes.append(f"{name}: {recorded.get(name, '(unset)')!r} → {wanted.get(name, '(unset)')!r}")
    if progress.base_model is not None and progress.base_model != base_model:
        changes.append(f"base model: {progress.base_model} → {base_model}")
    if progress.training_data is not None and progress.training_data != list(training_data):
        changes.append(f"training data: {', '.join(progress.training_data)} → {', '.join(training_data)}")
    return changes


def refuse_changed_settings(run_directory: str | Path, checkpoint_name: str, progress: TrainingProgress,
                            config: TrainingConfig, base_model: str, training_data: list[str]) -> None:
    """Raise a ConfigError when a relaunch would resume or report a run started with other settings
    (`settings_changed_since`)."""
    if changes := settings_changed_since(progress, config, base_model, training_data):
        state = "a finished run" if progress.finished else "an unfinished run"
        raise ConfigError(
            f"run folder {run_directory} holds {state} (checkpoint {checkpoint_name}, step {progress.step}) started "
            f"with other settings: {'; '.join(changes)}. Use another run_name, or remove {run_directory} to start "
            "afresh")


def _flat_settings(values: dict) -> dict:
    """A config as TrainingConfig reads it (defaults filled in for fields added since), dotted."""
    try:
        values = TrainingConfig.model_validate(values).model_dump(mode="json")
    except ValueError:
        pass  # a field since removed or restricted: compared as recorded
    return dotted_settings(values)


def rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(
    directory: Path, engine, rank: int, progress: TrainingProgress, loader_state: dict, *, engine_state: bool = True
) -> None:
    """Collective: every rank must call it, with the same ``engine_state`` (DeepSpeed saves its
    shards on each). ``engine_state=False`` leaves out ``deepspeed/`` (the final checkpoint)."""
    if engine_state:
        # Frozen weights (a LoRA/QLoRA base: nearly all of the model) never change, and a resume loads
        # them from the base model as the first start did; saving them made every checkpoint as large as
        # the model (twice under ZeRO-2, whose frozen-parameter fragments come on top).
        engine.save_checkpoint(str(directory / ENGINE_DIR), tag=ENGINE_TAG, exclude_frozen_parameters=True)
    torch.save({"rng": rng_states(), "loader": loader_state}, directory / f"worker-{rank}.pt")
    if rank == 0:
        (directory / PROGRESS_FILE).write_text(json.dumps(asdict(progress)))


def seal_checkpoint(directory: Path, rank: int) -> None:
    """This rank's last write into its checkpoint folder: the manifest of the files it wrote."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        relative = path.relative_to(directory).as_posix()
        if not relative.startswith(MANIFEST_PREFIX):
            files[relative] = [path.stat().st_size, file_digest(path)]
    (directory / f"{MANIFEST_PREFIX}{rank}.json").write_text(json.dumps(files, sort_keys=True))


def verify_checkpoint_files(directory: Path, *, world_size: int | None = None, only: str = "",
                            check_digests: bool = True) -> list[str]:
    """What is wrong with a checkpoint folder against its ranks' manifests ("path (missing|
    truncated|changed)", "files-<rank>.json (missing or unreadable)"), [] when nothing. `only`
    limits the check to files under that folder; sizes alone are cheap and catch an interrupted
    upload.

    Every rank of the world that wrote the folder must have sealed it: `world_size`, or when not
    given the one its progress.json records (a folder without a readable progress.json is
    incomplete). The manifests present cannot tell: with rank 0's lost, rank 1's lists none of
    rank 0's files (the model, progress.json), and the folder would look whole."""
    problems, expected = [], {}
    if world_size is None:
        try:
            world_size = load_progress(directory).world_size
        except (OSError, ValueError, TypeError, KeyError):
            problems.append(f"{PROGRESS_FILE} (missing or unreadable)")
            world_size = 1  # rank 0 seals every checkpoint
    on_disk = {int(p.stem.removeprefix(MANIFEST_PREFIX)) for p in directory.glob(f"{MANIFEST_PREFIX}*.json")
               if p.stem.removeprefix(MANIFEST_PREFIX).isdigit()}
    for rank in sorted(set(range(max(world_size, 1))) | on_disk):
        try:
            manifest = json.loads((directory / f"{MANIFEST_PREFIX}{rank}.json").read_text())
        except (OSError, ValueError):
            problems.append(f"{MANIFEST_PREFIX}{rank}.json (missing or unreadable)")
            continue
        for relative, (size, digest) in manifest.items():
            if relative == only or relative.startswith(f"{only}/") or not only:
                expected.setdefault(relative, []).append((size, digest))
    for relative, versions in sorted(expected.items()):
        path = directory / relative
        if not path.is_file():
            problems.append(f"{relative} (missing)")
        elif path.stat().st_size not in {size for size, _ in versions}:
            problems.append(f"{relative} (truncated or resized)")
        elif check_digests and file_digest(path) not in {digest for _, digest in versions}:
            problems.append(f"{relative} (changed)")
    return problems


def load_progress(directory: Path) -> TrainingProgress:
    data = json.loads((directory / PROGRESS_FILE).read_text())
    data["loss_history"] = [tuple(pair) for pair in data["loss_history"]]
    return TrainingProgress(**data)


WORKER_GROUP_STARTS = "worker-group-starts.log"


def record_worker_group_start(run_directory: Path) -> int:
    """Append one line for this start of the run's worker group (rank 0's, once per start) to a file
    in the run's storage folder, and return how many starts it holds, this one included. Counted
    here, not in the checkpoints: a group restarted before the first checkpoint resumes nothing, and
    two restarts after the same checkpoint both resume its count. One short O_APPEND write: a start
    is a whole line or none."""
    path = run_directory / WORKER_GROUP_STARTS
    path.parent.mkdir(parents=True, exist_ok=True)
    line = f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {os.uname().nodename} pid {os.getpid()}\n".encode()
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, line)
    finally:
        os.close(descriptor)
    return path.read_bytes().count(b"\n")


def restarts_on_resume(checkpointed: TrainingProgress | None, earlier_starts: int) -> int:
    """The run's restarts as its worker group starts again: ``earlier_starts`` (the group's starts
    before this one) with no checkpoint; with one, its count plus this restart, or ``earlier_starts``
    where that is more (two restarts after one checkpoint; the checkpoint's count alone covers runs
    checkpointed before starts were recorded). Resuming a finished run trains nothing: no restart."""
    if checkpointed is None:
        return earlier_starts
    if checkpointed.finished:
        return checkpointed.restarts
    return max(checkpointed.restarts + 1, earlier_starts)


def find_latest_checkpoint(run_directory: Path) -> Path | None:
    """The newest complete checkpoint under a Ray Train run folder (local storage), or None.

    Ray hands the latest *registered* checkpoint to restarted workers, but a worker that dies
    right after reporting can beat the registration; the files are already on disk, so we look.
    Complete = progress.json plus every rank's manifest, with each listed file at its size; an
    unfinished checkpoint must also hold engine state.
    """
    best: tuple[int, str, Path] | None = None
    for candidate in run_directory.glob("checkpoint_*") if run_directory.is_dir() else ():
        try:
            progress = load_progress(candidate)
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if problems := verify_checkpoint_files(candidate, world_size=progress.world_size, check_digests=False):
            log.warning("skipping incomplete checkpoint %s: %s", candidate, ", ".join(problems[:5]))
            continue
        if not progress.finished and not (candidate / ENGINE_DIR).is_dir():
            # An earlier checkpoint of a finished run, its engine state dropped after publishing.
            log.info("skipping checkpoint %s (step %d): it has no %s/ engine state to resume from",
                        candidate, progress.step, ENGINE_DIR)
            continue
        key = (progress.step, candidate.name, candidate)
        if best is None or key[:2] > best[:2]:
            best = key
    return best[2] if best else None


def drop_engine_state_of_earlier_checkpoints(run_directory: Path, final_checkpoint: Path) -> list[Path]:
    """Delete ``deepspeed/`` from a finished run's checkpoints other than its final one; call it
    only once the final model is published. Returns the checkpoint folders it changed.

    Ray keeps the last 2 checkpoints, so the one before the final keeps DeepSpeed's engine state:
    for a full fine-tune, the optimizer state alone is several times the model. Nothing resumes
    from it once the final checkpoint exists (a relaunch of the finished run reports that
    checkpoint's model again), but until the model is published a relaunch may still need it.
    Only this run's own checkpoint folders are touched: ``checkpoint_*`` folders directly in
    `run_directory` (which must hold `final_checkpoint`) whose progress.json reads as an unfinished
    run at the final step or an earlier one. Each rank's manifest is then rewritten without the
    removed files, so the folder still verifies and Ray's checkpoint list naming it is not set aside
    on a relaunch; `find_latest_checkpoint` never resumes from it. A failure to delete is logged, not raised: the
    model is already published."""
    try:
        same_run = run_directory.is_dir() and final_checkpoint.resolve().parent == run_directory.resolve()
        final = load_progress(final_checkpoint) if same_run else None
    except (OSError, ValueError, TypeError, KeyError):
        final = None
    if final is None or not final.finished:
        log.warning("not removing earlier engine state: %s is not a finished checkpoint of run folder %s",
                    final_checkpoint, run_directory)
        return []
    changed = []
    for candidate in sorted(run_directory.glob("checkpoint_*")):
        engine_state = candidate / ENGINE_DIR
        if candidate.is_symlink() or candidate.resolve() == final_checkpoint.resolve() or not engine_state.is_dir() \
                or engine_state.is_symlink():
            continue
        try:
            progress = load_progress(candidate)
        except (OSError, ValueError, TypeError, KeyError):
            continue  # not a checkpoint we can tell is ours: left alone
        # At the final step too: when max_epochs ends the run on a checkpoint step, the periodic
        # checkpoint and the final one share it.
        if progress.finished or progress.step > final.step:
            continue
        try:
            # Files first, manifests after: a kill in between leaves a folder whose manifests name
            # missing files, which is skipped on resume, never one that looks resumable.
            shutil.rmtree(engine_state)
            _drop_from_manifests(candidate, f"{ENGINE_DIR}/")
        except OSError as error:
            log.warning("could not remove the engine state of %s (step %d): %s", candidate, progress.step, error)
            continue
        log.info("removed the engine state of checkpoint %s (step %d): superseded by the published model",
                 candidate, progress.step)
        changed.append(candidate)
    return changed


def _drop_from_manifests(directory: Path, prefix: str) -> None:
    for manifest_path in directory.glob(f"{MANIFEST_PREFIX}*.json"):
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError):
            continue  # already incomplete; verification reports it
        kept = {relative: entry for relative, entry in manifest.items() if not relative.startswith(prefix)}
        staged = manifest_path.with_name(f".{manifest_path.name}.tmp")
        staged.write_text(json.dumps(kept, sort_keys=True))
        os.replace(staged, manifest_path)


RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train V2's list of a run's registered checkpoints


@dataclass(frozen=True)
class RayCheckpointList:
    """What Ray Train's checkpoint list (RAY_SNAPSHOT) says of a run: checkpoint folder names."""

    ray_version: str | None
    registered: list[str]  # checkpoint_results
    latest: str | None  # latest_checkpoint_result: what Ray hands the workers on a relaunch
    pending: list[str]  # pending_training_results

    @property
    def named(self) -> set[str]:
        return {*self.registered, *self.pending, *([self.latest] if self.latest else [])}


def read_ray_checkpoint_list(run_directory: Path) -> RayCheckpointList:
    """Raises ValueError (its cause chained) when the list is missing, unreadable or not shaped as
    Ray 2.60 writes it."""
    try:
        state = json.loads((run_directory / RAY_SNAPSHOT).read_text())
        latest = state.get("latest_checkpoint_result")
        return RayCheckpointList(
            ray_version=state.get("ray_version"),
            registered=[result["checkpoint_dir_name"] for result in state.get("checkpoint_results", [])],
            latest=latest["checkpoint_dir_name"] if latest else None,
            pending=[result["checkpoint_dir_name"] for result in state.get("pending_training_results", []) if result],
        )
    except (OSError, ValueError, AttributeError, TypeError, KeyError) as error:
        raise ValueError(f"{error.__class__.__name__}: {error}") from error


def set_aside_unusable_ray_snapshot(run_directory: Path, ray_version: str) -> str | None:
    """Move Ray's checkpoint list out of the way when Ray could not resume from it, and say why.

    Ray refuses to start a run whose snapshot is unreadable, from another Ray version, or names a
    checkpoint folder that is gone, on every relaunch, until someone deletes the folder by hand;
    and it would hand workers a registered checkpoint damaged since. Without the snapshot the
    workers resume from the newest complete checkpoint on disk (`find_latest_checkpoint`)."""
    snapshot = run_directory / RAY_SNAPSHOT
    if not snapshot.is_file():
        return None
    try:
        listed = read_ray_checkpoint_list(run_directory)
        recorded_version, names = listed.ray_version, listed.registered
    except ValueError as error:
        reason = f"unreadable ({error})"
    else:
        damaged = {name: verify_checkpoint_files(run_directory / name, check_digests=False)
                   for name in names if (run_directory / name).is_dir()}
        if recorded_version != ray_version:
            reason = f"written by Ray {recorded_version}, this is Ray {ray_version}"
        elif missing := [name for name in names if not (run_directory / name).is_dir()]:
            reason = f"lists checkpoint(s) that are gone: {', '.join(missing)}"
        elif damaged := {name: problems for name, problems in damaged.items() if problems}:
            reason = "lists damaged checkpoint(s): " + "; ".join(
                f"{name}: {', '.join(problems[:3])}" for name, problems in damaged.items())
        else:
            return None
    aside = snapshot.with_name(f"{RAY_SNAPSHOT}.unusable-{int(time.time())}")
    os.replace(snapshot, aside)
    log.warning("Ray's checkpoint list %s is %s; moved to %s, resuming from the newest complete checkpoint on disk",
                snapshot, reason, aside.name)
    return reason


def remove_checkpoints_ray_does_not_keep(run_directory: Path, final_checkpoint: Path) -> list[Path]:
    """Delete a finished run's ``checkpoint_*`` folders that Ray's checkpoint list does not name;
    call it only once the final model is published. Returns the folders removed.

    Ray deletes only the checkpoints its list holds beyond ``num_to_keep``; those it never knew of
    stay for good: the ones a set-aside list named (`set_aside_unusable_ray_snapshot`), and one
    uploaded by a worker killed before Ray registered it. Nothing resumes from them once the run
    has finished. Only folders holding a file of ours (progress.json, a manifest, a worker-<rank>.pt)
    are removed; nothing is when the list is unreadable or lacks `final_checkpoint`."""
    try:
        listed = read_ray_checkpoint_list(run_directory).named
    except ValueError as error:
        log.warning("not removing checkpoints Ray does not list: its list %s is unreadable (%s)",
                    run_directory / RAY_SNAPSHOT, error)
        return []
    if final_checkpoint.parent.resolve() != run_directory.resolve() or final_checkpoint.name not in listed:
        log.warning("not removing checkpoints Ray does not list: its list in %s does not name the final checkpoint %s",
                    run_directory, final_checkpoint)
        return []
    removed = []
    for candidate in sorted(run_directory.glob("checkpoint_*")):
        if candidate.name in listed or candidate.is_symlink() or not _holds_a_file_of_ours(candidate):
            continue
        try:
            shutil.rmtree(candidate)  # a kill midway leaves a folder that no longer verifies: never resumed
        except OSError as error:
            log.warning("could not remove checkpoint %s, which Ray does not list: %s", candidate, error)
            continue
        log.info("removed checkpoint %s: Ray's list does not name it, so Ray would never delete it", candidate)
        removed.append(candidate)
    return removed


def _holds_a_file_of_ours(directory: Path) -> bool:
    patterns = (PROGRESS_FILE, f"{MANIFEST_PREFIX}*.json", "worker-*.pt")
    return directory.is_dir() and any(next(directory.glob(pattern), None) is not None for pattern in patterns)


def checkpoint_a_relaunch_resumes_from(run_directory: Path) -> Path | None:
    """The checkpoint folder a relaunch's workers will resume from, or None for a fresh start.

    Ray hands the workers the latest checkpoint of its list (``latest_checkpoint_result``); with
    no list, or none in it, they take the newest complete one on disk (`find_latest_checkpoint`).
    Call it after `set_aside_unusable_ray_snapshot`, which moves away a list Ray would not use."""
    try:
        if latest := read_ray_checkpoint_list(run_directory).latest:
            return run_directory / latest
    except ValueError:
        pass  # no usable list: Ray hands the workers no checkpoint
    return find_latest_checkpoint(run_directory)


def restore_checkpoint(directory: Path, engine, rank: int) -> tuple[TrainingProgress, dict | None]:
    """Load engine state and this rank's RNG/loader state. Returns (progress, loader_state).

    The loader state is global and elastic: the reader's position loads at any rank and world
    size, so a rank with no file of its own (the world grew) takes rank 0's and keeps fresh RNG.
    The engine state is not: under ZeRO (stage >= 1) DeepSpeed partitions the optimizer state
    across the ranks that saved it and loads it only at that world size, so an unfinished run
    resumes at another world size only under ZeRO-0 (the launcher refuses the rest before any
    worker starts, `check_relaunch_world_size`). A finished run's final checkpoint has no engine
    state, so a relaunch at any world size works: the engine is left as it is (the caller takes
    the model from ``model/``).
    """
    progress = load_progress(directory)
    if (directory / ENGINE_DIR).is_dir():
        engine.load_checkpoint(str(directory / ENGINE_DIR), tag=ENGINE_TAG, load_module_strict=False)
    elif not progress.finished:
        raise RuntimeError(
            f"checkpoint {directory} (step {progress.step}) has no {ENGINE_DIR}/ engine state to resume from"
        )
    own = directory / f"worker-{rank}.pt"
    worker_state = torch.load(own if own.exists() else directory / "worker-0.pt", weights_only=False)
    if own.exists():
        restore_rng_states(worker_state["rng"])
    return progress, worker_state["loader"]
