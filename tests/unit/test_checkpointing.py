"""Checkpoint folders without DeepSpeed: which ones may be resumed, and what a resume restores.

The engine is a recorder of the calls made to it: this tests our own resume logic; real DeepSpeed
checkpoints are exercised in tests/integration/test_training_runs.py."""

from __future__ import annotations

import random
import re

import pytest

from training_core.train.checkpointing import (
    ENGINE_DIR,
    TrainingProgress,
    restore_checkpoint,
    save_checkpoint,
)


class RecordingEngine:
    def __init__(self) -> None:
        self.saved: list[str] = []
        self.loaded: list[str] = []

    def save_checkpoint(self, directory: str, tag: str) -> None:
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
