"""Training is not Llama-only: a GPT-2 (Conv1D projections, learned positions, other module names)
built from config and loaded with `from_pretrained` from a folder, as a user's model would be."""
from __future__ import annotations

from pathlib import Path

import pytest

from training_core.base_model import load_tokenizer, resolve_pretrained
from training_core.evaluate.compare import evaluate_against_base
from training_core.errors import ConfigError
from training_core.train.config import TrainingConfig
from training_core.train.launcher import run_training

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gpt2_folder(demo_model, tmp_path_factory) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = load_tokenizer(demo_model.name_or_path)
    folder = tmp_path_factory.mktemp("gpt2")
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=len(tokenizer), n_positions=128,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_gpt2_model_trains_and_evaluates(ray_session, gpt2_folder, demo_dataset, tmp_path, method):
    from training_core.data.dataset_writer import read_eval_records

    assert resolve_pretrained(str(gpt2_folder)).source == "pretrained"
    # GPT-2 names its embeddings wte; a random base needs them trained next to LoRA, as the demo does
    lora = {"modules_to_save": ["wte", "lm_head"]} if method == "lora" else {}
    config = TrainingConfig(method=method, lora=lora, max_steps=20, num_workers=1, checkpoint_every_steps=20,
                            warmup_steps=2)
    result = run_training(config, model_path=str(gpt2_folder), train_dirs=[str(demo_dataset.train_dir)],
                          seq_len=demo_dataset.seq_len, cache_dir=str(tmp_path / "cache"),
                          storage_path=tmp_path / "ray", run_name=f"gpt2-{method}", output_dir=tmp_path / "models")
    losses = [loss for _, loss in result.loss_history]
    assert losses[-1] < losses[0]
    saved = {path.name for path in Path(result.model_dir).iterdir()}
    assert ("adapter_model.safetensors" in saved) if method == "lora" else ("model.safetensors" in saved)
    base, trained = evaluate_against_base(str(gpt2_folder), result.model_dir, read_eval_records(demo_dataset.path))
    assert trained.loss < base.loss


def test_rows_longer_than_gpt2_positions_are_refused_before_workers_start(gpt2_folder, demo_dataset, tmp_path):
    with pytest.raises(ConfigError, match=r"seq_len=256 are longer than base model .* allows \(max_position_embeddings=128\)"):
        run_training(TrainingConfig(num_workers=1), model_path=str(gpt2_folder),
                     train_dirs=[str(demo_dataset.train_dir)], seq_len=256, cache_dir=None,
                     storage_path=tmp_path / "ray", run_name="too-long", output_dir=tmp_path / "models")
