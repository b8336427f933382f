"""A training loss that became NaN fails the run once, naming the step it was first seen at, and
leaves no checkpoint or model trained past it. Before, the run trained on, recorded NaN losses and
published its model."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file, save_file

from training_core.errors import TrainingDivergedError
from training_core.train.batches import EpochBatches
from training_core.train.checkpointing import load_progress
from training_core.train.config import TrainingConfig
from training_core.train.launcher import run_training
from training_core.train.loop import WorkerInputs
from training_core.train.repeatable_failures import RECORD_NAME

pytestmark = pytest.mark.integration

CONFIG = TrainingConfig(num_workers=1, max_steps=6, checkpoint_every_steps=3, warmup_steps=0)
NAN_STEP = 4  # after the checkpoint of step 3; the run ends at step 6 with its final check
UNUSED_TOKEN = 3  # the demo tokenizer's unk: no demo row holds it


def _rows_of_step(train_dir: Path, step: int) -> np.ndarray:
    """The input_ids of ``step``'s batch, read with the loader the worker uses (one worker)."""
    inputs = WorkerInputs(config=CONFIG.model_dump(), model_path="", train_dirs=[str(train_dir)], cache_dir=None,
                          seq_len=0)
    batches = EpochBatches(inputs, CONFIG, rank=0, world_size=1, epoch=0, state=None)
    try:
        for _ in range(step):
            batch = batches.next()
    finally:
        batches.close()
    return batch["input_ids"].numpy()


def _data_with_a_token_first_read_at(step: int, train_dir: Path, directory: Path) -> Path:
    """A copy of the demo training data in which one row of ``step``'s batch holds UNUSED_TOKEN in a
    trained example. The same row groups: the loader's order depends on the seed and their sizes."""
    [path] = sorted(train_dir.glob("*.parquet"))
    file = pq.ParquetFile(path)
    table = file.read()
    rows = np.array(table.column("input_ids").to_pylist())
    labels = np.array(table.column("labels").to_pylist())
    [row] = np.flatnonzero((rows == _rows_of_step(train_dir, step)[0]).all(axis=1))
    rows[row, np.flatnonzero(labels[row] >= 0)[0]] = UNUSED_TOKEN  # an answer token: the layout is unchanged
    table = table.set_column(0, "input_ids", pa.array(rows.tolist(), table.schema.field("input_ids").type))
    directory.mkdir()
    with pq.ParquetWriter(directory / path.name, table.schema) as writer:
        offset = 0
        for group in range(file.metadata.num_row_groups):
            size = file.metadata.row_group(group).num_rows
            writer.write_table(table.slice(offset, size))
            offset += size
    assert not (_rows_of_step(directory, step - 1) == UNUSED_TOKEN).any()
    assert (_rows_of_step(directory, step) == UNUSED_TOKEN).any()
    return directory


def test_a_loss_that_became_nan_fails_the_run_once_naming_its_first_step(ray_session, demo_model, demo_dataset,
                                                                         tmp_path):
    train_dir = _data_with_a_token_first_read_at(NAN_STEP, Path(demo_dataset.train_dir), tmp_path / "data")
    # A base model whose embedding of that token is NaN (a damaged checkpoint): the loss of step 4 is NaN.
    model_path = tmp_path / "base-with-a-nan-row"
    shutil.copytree(demo_model.name_or_path, model_path)
    weights = load_file(model_path / "model.safetensors")
    weights["model.embed_tokens.weight"][UNUSED_TOKEN] = math.nan
    save_file(weights, model_path / "model.safetensors", metadata={"format": "pt"})

    with pytest.raises(TrainingDivergedError, match=r"^training diverged: the training loss was nan at step 4 \(first "
                                                    r"seen when the losses of steps 4-6 were gathered\); no checkpoint "
                                                    r"or model is written from it") as failure:
        run_training(CONFIG, model_path=str(model_path), train_dirs=[str(train_dir)], seq_len=demo_dataset.seq_len,
                     cache_dir=None, storage_path=tmp_path / "ray", run_name="nan", output_dir=tmp_path / "models",
                     max_failures=2)
    # Recorded and not retried: the same seed and data diverge again.
    assert (tmp_path / "ray" / "nan" / RECORD_NAME).exists()
    assert "not retried: an earlier attempt of this run failed on rank 0 with TrainingDivergedError" in str(
        failure.value.__cause__)
    # The checkpoint of step 3 is kept, with finite losses; none after it, and no model.
    progress = [load_progress(path) for path in (tmp_path / "ray" / "nan").glob("checkpoint_*") if path.is_dir()]
    assert [p.step for p in progress] == [3]
    assert [step for step, _ in progress[0].loss_history] == [1, 2, 3]
    assert all(math.isfinite(loss) for _, loss in progress[0].loss_history)
    # The driver's error carries that finite curve, for the run's MLflow record (steps 4-6 were one report).
    assert failure.value.loss_history == progress[0].loss_history
    assert not list((tmp_path / "models").rglob("*.safetensors"))
