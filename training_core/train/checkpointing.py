"""Training checkpoints: DeepSpeed engine state (model, optimizer, scheduler) plus, per rank, the
RNG states and the loader position, plus the shared progress (step, loss curve, restarts).

Layout of one checkpoint directory (Ray Train merges every rank's files into it):
    deepspeed/            engine.save_checkpoint(tag=ENGINE_TAG); every rank writes its shard.
                          Not in the final checkpoint: a finished run resumes nothing, and for a
                          full fine-tune the optimizer state alone is several times the model.
    worker-<rank>.pt      python / numpy / torch RNG states and the reader's state_dict
    progress.json         written by rank 0
    model/                final checkpoint only: the adapter (LoRA) or full model, save_pretrained
    files-<rank>.json     written last by each rank: size and XXH3-128 of every file it wrote
                          (`seal_checkpoint`); a folder found on disk is trusted only when every
                          rank's manifest is there and matches (Ray uploads ranks in parallel,
                          and a worker killed mid-upload leaves truncated files behind)
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash

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
            files[relative] = [path.stat().st_size, _file_digest(path)]
    (directory / f"{MANIFEST_PREFIX}{rank}.json").write_text(json.dumps(files, sort_keys=True))


def verify_checkpoint_files(directory: Path, *, world_size: int | None = None, only: str = "",
                            check_digests: bool = True) -> list[str]:
    """What is wrong with a checkpoint folder against its ranks' manifests ("path (missing|
    truncated|changed)", "files-<rank>.json (missing)"), [] when nothing. `only` limits the check
    to files under that folder; sizes alone are cheap and catch an interrupted upload."""
    problems, expected = [], {}
    ranks = range(world_size) if world_size is not None else sorted(
        int(p.stem.removeprefix(MANIFEST_PREFIX)) for p in directory.glob(f"{MANIFEST_PREFIX}*.json")
        if p.stem.removeprefix(MANIFEST_PREFIX).isdigit())
    for rank in ranks:
        try:
            manifest = json.loads((directory / f"{MANIFEST_PREFIX}{rank}.json").read_text())
        except (OSError, ValueError):
            problems.append(f"{MANIFEST_PREFIX}{rank}.json (missing or unreadable)")
            continue
        for relative, (size, digest) in manifest.items():
            if relative == only or relative.startswith(f"{only}/") or not only:
                expected.setdefault(relative, []).append((size, digest))
    if not ranks:
        problems.append(f"{MANIFEST_PREFIX}<rank>.json (missing)")
    for relative, versions in sorted(expected.items()):
        path = directory / relative
        if not path.is_file():
            problems.append(f"{relative} (missing)")
        elif path.stat().st_size not in {size for size, _ in versions}:
            problems.append(f"{relative} (truncated or resized)")
        elif check_digests and _file_digest(path) not in {digest for _, digest in versions}:
            problems.append(f"{relative} (changed)")
    return problems


def _file_digest(path: Path) -> str:
    hasher = xxhash.xxh3_128()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            hasher.update(chunk)
    return hasher.hexdigest()


def load_progress(directory: Path) -> TrainingProgress:
    data = json.loads((directory / PROGRESS_FILE).read_text())
    data["loss_history"] = [tuple(pair) for pair in data["loss_history"]]
    return TrainingProgress(**data)


def find_latest_checkpoint(run_directory: Path) -> Path | None:
    """The newest complete checkpoint under a Ray Train run folder (local storage), or None.

    Ray hands the latest *registered* checkpoint to restarted workers, but a worker that dies
    right after reporting can beat the registration; the files are already on disk, so we look.
    Complete = progress.json plus every rank's manifest, with each listed file at its size.
    """
    best: tuple[int, str, Path] | None = None
    for candidate in run_directory.glob("checkpoint_*") if run_directory.is_dir() else ():
        try:
            progress = load_progress(candidate)
        except (OSError, ValueError, TypeError):
            continue
        if problems := verify_checkpoint_files(candidate, world_size=progress.world_size, check_digests=False):
            log.warning("skipping incomplete checkpoint %s: %s", candidate, ", ".join(problems[:5]))
            continue
        key = (progress.step, candidate.name, candidate)
        if best is None or key[:2] > best[:2]:
            best = key
    return best[2] if best else None


RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train V2's list of a run's registered checkpoints


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
        state = json.loads(snapshot.read_text())
        recorded_version = state.get("ray_version")
        names = [result["checkpoint_dir_name"] for result in state.get("checkpoint_results", [])]
    except (OSError, ValueError, AttributeError, TypeError, KeyError) as error:
        reason = f"unreadable ({error.__class__.__name__}: {error})"
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


def restore_checkpoint(directory: Path, engine, rank: int) -> tuple[TrainingProgress, dict | None]:
    """Load engine state and this rank's RNG/loader state. Returns (progress, loader_state).

    A rank with no file of its own (the world grew) keeps fresh RNG and takes rank 0's loader
    state: the reader's state is global, so any rank may load it. A finished run's final
    checkpoint has no engine state: the engine is left as it is (the caller takes the model from
    ``model/``).
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
