"""Training checkpoints: DeepSpeed engine state (model, optimizer, scheduler) plus, per rank, the
RNG states and the loader position, plus the shared progress (step, loss curve, restarts).

Layout of one checkpoint directory (Ray Train merges every rank's files into it):
    deepspeed/            engine.save_checkpoint(tag=ENGINE_TAG); every rank writes its shard.
                          Not in the final checkpoint: a finished run resumes nothing, and for a
                          full fine-tune the optimizer state alone is several times the model.
    worker-<rank>.pt      python / numpy / torch RNG states and the reader's state_dict
    progress.json         written by rank 0
    model/                final checkpoint only: the adapter (LoRA) or full model, save_pretrained
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

ENGINE_TAG = "engine"
ENGINE_DIR = "deepspeed"
PROGRESS_FILE = "progress.json"
MODEL_DIR = "model"


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
        engine.save_checkpoint(str(directory / ENGINE_DIR), tag=ENGINE_TAG)
    torch.save({"rng": rng_states(), "loader": loader_state}, directory / f"worker-{rank}.pt")
    if rank == 0:
        (directory / PROGRESS_FILE).write_text(json.dumps(asdict(progress)))


def load_progress(directory: Path) -> TrainingProgress:
    data = json.loads((directory / PROGRESS_FILE).read_text())
    data["loss_history"] = [tuple(pair) for pair in data["loss_history"]]
    return TrainingProgress(**data)


def find_latest_checkpoint(run_directory: Path) -> Path | None:
    """The newest complete checkpoint under a Ray Train run folder (local storage), or None.

    Ray hands the latest *registered* checkpoint to restarted workers, but a worker that dies
    right after reporting can beat the registration; the files are already on disk, so we look.
    Complete = progress.json plus every rank's worker file.
    """
    best: tuple[int, str, Path] | None = None
    for candidate in run_directory.glob("checkpoint_*") if run_directory.is_dir() else ():
        try:
            progress = load_progress(candidate)
        except (OSError, ValueError, TypeError):
            continue
        if not all((candidate / f"worker-{rank}.pt").exists() for rank in range(progress.world_size)):
            continue
        key = (progress.step, candidate.name, candidate)
        if best is None or key[:2] > best[:2]:
            best = key
    return best[2] if best else None


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
