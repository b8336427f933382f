"""A step's loss is the mean over every trained token of its global batch, however the batch is split:
the same rows as one micro-batch of 2 or as 2 accumulated micro-batches of 1 train the same model.

Real Ray Train + DeepSpeed (CPU) full-parameter runs on the tiny demo model, one worker each."""

from __future__ import annotations

import numpy as np
import pytest

from tests.integration.test_training_runs import _weights
from training_core.base_model import load_tokenizer
from training_core.data.dataset_writer import DatasetSpec, write_dataset
from training_core.data.demo_task import ALPHABET, make_record
from training_core.train.config import TrainingConfig
from training_core.train.launcher import run_training

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def uneven_dataset(demo_model, tmp_path_factory):
    """Rows that train very different numbers of tokens (4 to 31 in the first steps): words of 1, 2,
    24 and 28 letters, packed greedily. The demo's own rows all train 25, where no split shows."""
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list(ALPHABET), size=int(length))) for length in rng.choice([1, 2, 24, 28], size=300)]
    return write_dataset([make_record(word) for word in words], load_tokenizer(demo_model.name_or_path),
                         tmp_path_factory.mktemp("uneven"), DatasetSpec(row_group_rows=16), source_label="uneven")


def test_accumulated_micro_batches_train_as_one_batch(ray_session, demo_model, uneven_dataset, tmp_path):
    def train(micro_batch_size: int, gradient_accumulation_steps: int):
        config = TrainingConfig(method="full", micro_batch_size=micro_batch_size,
                                gradient_accumulation_steps=gradient_accumulation_steps, num_workers=1,
                                max_steps=4, checkpoint_every_steps=2, warmup_steps=1)
        name = f"micro{micro_batch_size}-gas{gradient_accumulation_steps}"
        return run_training(config, model_path=demo_model.name_or_path, train_dirs=[str(uneven_dataset.train_dir)],
                            seq_len=uneven_dataset.seq_len, cache_dir=str(tmp_path / "cache"),
                            storage_path=tmp_path / "ray", run_name=name, output_dir=tmp_path / "models")

    one_batch, accumulated = train(2, 1), train(1, 2)  # the loader's row order does not depend on the split

    steps = [step for step, _ in one_batch.loss_history]
    assert steps == [step for step, _ in accumulated.loss_history] == [1, 2, 3, 4]
    assert [loss for _, loss in accumulated.loss_history] == pytest.approx(
        [loss for _, loss in one_batch.loss_history], rel=1e-5)
    weights, accumulated_weights = _weights(one_batch), _weights(accumulated)
    assert weights.keys() == accumulated_weights.keys()
    for key, value in weights.items():
        assert accumulated_weights[key].allclose(value, rtol=1e-4, atol=5e-5), key
