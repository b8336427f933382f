"""A sliding-window model trains with its window: the training loop builds each packed row's mask
with the model's window (transformers takes a 4-D mask as given, adding none), so the first step's
loss is the model's own loss on that row, not the loss of the same row under full causal attention.

Real Ray Train + DeepSpeed (CPU), one worker, on a tiny Mistral whose window is shorter than the row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from tests.unit.tokenizer_support import is_eval_prompt
from training_core.base_model import load_tokenizer
from training_core.data.dataset_writer import DatasetSpec, write_dataset
from training_core.data.demo_task import ALPHABET, make_record
from training_core.train.config import TrainingConfig
from training_core.train.launcher import run_training

pytestmark = pytest.mark.integration

WINDOW = 4
WORD_LENGTH = 20  # one example of ~43 tokens: ten windows long, one per 64-token row


@pytest.fixture(scope="module")
def mistral_folder(demo_model, tmp_path_factory) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    tokenizer = load_tokenizer(demo_model.name_or_path)
    folder = tmp_path_factory.mktemp("mistral")
    config = MistralConfig(sliding_window=WINDOW, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                           max_position_embeddings=128, initializer_range=0.3,  # sharp attention: the window shows
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def one_row_dataset(mistral_folder, tmp_path_factory):
    """One training row (so the first step trains on it whichever order the loader takes), plus the
    held-out records the writer needs."""
    tokenizer = load_tokenizer(str(mistral_folder))
    spec = DatasetSpec()
    rng = np.random.default_rng(0)
    words = ("".join(rng.choice(list(ALPHABET), size=WORD_LENGTH)) for _ in range(10_000))
    train, held_out = [], []
    for record in map(make_record, words):
        (held_out if is_eval_prompt(tokenizer, record["prompt"], spec.eval_fraction) else train).append(record)
        if train and len(held_out) >= 2:
            break
    return write_dataset([train[0], *held_out], tokenizer, tmp_path_factory.mktemp("one-row"), spec,
                         source_label="one row")


def _row_loss(folder: Path, row: dict, **config_changes) -> float:
    """The model's own loss on the row (its own causal mask; padding comes after the example)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", **config_changes).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([row["input_ids"]]), labels=torch.tensor([row["labels"]])).loss.item()


def test_the_first_step_trains_with_the_models_sliding_window(ray_session, mistral_folder, one_row_dataset, tmp_path):
    [row] = pq.read_table(Path(one_row_dataset.train_dir)).to_pylist()
    assert one_row_dataset.train_rows == 1 and sum(label != -100 for label in row["labels"]) > 2 * WINDOW
    windowed = _row_loss(mistral_folder, row)
    full = _row_loss(mistral_folder, row, sliding_window=None)
    assert abs(windowed - full) > 0.05 * windowed  # the window changes this row's loss

    config = TrainingConfig(method="full", num_workers=1, micro_batch_size=1, max_steps=1, checkpoint_every_steps=1,
                            warmup_steps=0)
    result = run_training(config, model_path=str(mistral_folder), train_dirs=[str(one_row_dataset.train_dir)],
                          seq_len=one_row_dataset.seq_len, cache_dir=None, storage_path=tmp_path / "ray",
                          run_name="mistral-window", output_dir=tmp_path / "models")
    [(step, first_loss)] = result.loss_history
    assert step == 1 and first_loss == pytest.approx(windowed, rel=1e-4)
