"""Before a run is reused or trains, its inputs must still be what their digests say: a base-model
folder overwritten in place, or a training window holding a day tokenized by another base model,
is refused by name before anything starts."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from training_core.base_model import load_tokenizer, resolve_pretrained
from training_core.data.dataset_writer import DatasetSpec, write_dataset
from training_core.data.demo_task import generate_records
from training_core.errors import LineageError, ModelNotFoundError
from training_core.runs import TrainingInputs, check_inputs_are_as_recorded, run_tracked_training
from training_core.tracking import MlflowTracking
from training_core.train.config import TrainingConfig


@pytest.fixture
def base(demo_model, tmp_path):
    folder = tmp_path / "my-base"
    shutil.copytree(demo_model.name_or_path, folder)
    return resolve_pretrained(str(folder))


def _dataset(base, root: Path, day: str, tokenized_with: str):
    """A published dataset whose manifest says which base model's tokenizer wrote it."""
    return write_dataset(generate_records(day, 300), load_tokenizer(base.name_or_path), root / "datasets" / day,
                         DatasetSpec(row_group_rows=64), source_label="test", extra_manifest={"tokenizer": tokenized_with})


def _inputs(base, datasets, keys) -> TrainingInputs:
    return TrainingInputs(base_model=base.name_or_path, base_model_digest=base.digest,
                          dataset_paths=[d.path for d in datasets], dataset_digest="window", seq_len=datasets[0].seq_len,
                          cache_directory=None, cache_version="cache", partition_keys=keys)


@pytest.mark.parametrize("role", ["pad_token", "bos_token"])
def test_a_special_token_outside_the_models_vocabulary_is_refused_naming_it(demo_model, tmp_path, role):
    # Added to the tokenizer, the embeddings never resized: training would call the data "tokenized
    # for another model", evaluation fail with a bare IndexError.
    from transformers import AutoTokenizer

    folder = tmp_path / "added-token"
    shutil.copytree(demo_model.name_or_path, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({role: "[ADDED]"})
    tokenizer.save_pretrained(folder)
    vocab = demo_model.vocab_size
    assert tokenizer.convert_tokens_to_ids("[ADDED]") == vocab
    with pytest.raises(ModelNotFoundError) as refused:
        resolve_pretrained(str(folder))
    assert str(refused.value) == (
        f"base model {folder}: its tokenizer's {role} '[ADDED]' has id {vocab}, outside the model's vocabulary "
        f"(vocab_size={vocab}, ids 0..{vocab - 1}), as when a token is added to the tokenizer without resizing the "
        "model: call model.resize_token_embeddings(len(tokenizer)) and save_pretrained the model, or set "
        f"{role} to a token inside the vocabulary")


def test_inputs_as_recorded_pass(base, tmp_path):
    datasets = [_dataset(base, tmp_path, day, base.digest) for day in ("2026-11-01", "2026-11-02")]
    check_inputs_are_as_recorded(_inputs(base, datasets, ["2026-11-01", "2026-11-02"]))


def test_a_base_model_overwritten_in_place_is_refused_before_a_reuse_or_training(base, tmp_path):
    datasets = [_dataset(base, tmp_path, "2026-11-01", base.digest)]
    config_file = Path(base.name_or_path) / "config.json"
    config_file.write_text(config_file.read_text().replace("{", '{"edited": true, ', 1))
    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")

    def must_not_start():
        raise AssertionError("training started on a changed base model")

    with pytest.raises(LineageError, match=rf"base model {base.name_or_path} changed since base_model was materialized "
                                           r"\(config\.json \(changed\)\); rematerialize base_model"):
        run_tracked_training(TrainingConfig(), _inputs(base, datasets, ["2026-11-01"]), tracking,
                             ray_storage=str(tmp_path / "ray"), models_dir=tmp_path / "models",
                             before_training=must_not_start)


def test_a_users_base_model_folder_is_never_written_to_and_its_changed_file_is_named(demo_model, tmp_path):
    folder = tmp_path / "users-model"
    shutil.copytree(demo_model.name_or_path, folder)
    (folder / ".file-digests.json").unlink()  # a user's folder: no record of ours inside
    before = sorted(p.name for p in folder.iterdir())
    records = tmp_path / "state" / "base-digests"
    base = resolve_pretrained(str(folder), records)
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing written into the user's folder
    dataset = _dataset(base, tmp_path, "2026-11-01", base.digest)
    check_inputs_are_as_recorded(_inputs(base, [dataset], ["2026-11-01"]), records)

    (folder / "generation_config.json").write_text("{}")
    with pytest.raises(LineageError, match=r"changed since base_model was materialized \(generation_config\.json "
                                           r"\(changed\)\)"):
        check_inputs_are_as_recorded(_inputs(base, [dataset], ["2026-11-01"]), records)
    with pytest.raises(LineageError, match=rf"\(contents \(digest {base.digest[:12]} then, \w{{12}} now\)\)"):
        check_inputs_are_as_recorded(_inputs(base, [dataset], ["2026-11-01"]))  # no record: digests compared


def test_a_window_day_tokenized_by_another_base_model_is_named(base, tmp_path):
    today = _dataset(base, tmp_path, "2026-11-02", base.digest)
    yesterday = _dataset(base, tmp_path, "2026-11-01", "0123456789abcdef-other-base")
    with pytest.raises(LineageError, match=r"training_dataset 2026-11-01 \(tokenized with base model 0123456789ab\) was "
                                           r"not tokenized with the base model being trained, .*my-base "
                                           rf"\({base.digest[:12]}\); rematerialize training_dataset for that partition"):
        check_inputs_are_as_recorded(_inputs(base, [yesterday, today], ["2026-11-01", "2026-11-02"]))


def test_a_window_day_whose_dataset_folder_was_pruned_says_to_rematerialize_it(base, tmp_path):
    today = _dataset(base, tmp_path, "2026-11-02", base.digest)
    yesterday = _dataset(base, tmp_path, "2026-11-01", base.digest)
    shutil.rmtree(yesterday.path)  # an operator freeing disk
    with pytest.raises(LineageError, match=rf"^training dataset {re.escape(yesterday.path)} is gone; rematerialize "
                                           r"training_dataset for 2026-11-01$"):
        check_inputs_are_as_recorded(_inputs(base, [yesterday, today], ["2026-11-01", "2026-11-02"]))


def test_datasets_written_before_the_tokenizer_was_recorded_are_accepted(base, tmp_path):
    dataset = _dataset(base, tmp_path, "2026-11-01", base.digest)
    manifest = Path(dataset.path) / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"tokenizer"', '"tokenizer_unrecorded"'))
    check_inputs_are_as_recorded(_inputs(base, [dataset], ["2026-11-01"]))


def test_a_caller_that_just_checked_the_base_model_skips_hashing_it_again_but_not_the_tokenizer_check(base, tmp_path):
    # `tessera reproduce` compares the base model with the run's record first; a second hash of a
    # 7B folder would read ~14 GB again. The window's tokenizer is still checked.
    today = _dataset(base, tmp_path, "2026-11-02", base.digest)
    config_file = Path(base.name_or_path) / "config.json"
    config_file.write_text(config_file.read_text().replace("{", '{"edited": true, ', 1))
    check_inputs_are_as_recorded(_inputs(base, [today], ["2026-11-02"]), base_model_checked=True)
    with pytest.raises(LineageError, match=r"changed since base_model was materialized"):
        check_inputs_are_as_recorded(_inputs(base, [today], ["2026-11-02"]))
    yesterday = _dataset(base, tmp_path, "2026-11-01", "0123456789abcdef-other-base")
    with pytest.raises(LineageError, match=r"training_dataset 2026-11-01 \(tokenized with base model 0123456789ab\)"):
        check_inputs_are_as_recorded(_inputs(base, [yesterday, today], ["2026-11-01", "2026-11-02"]),
                                     base_model_checked=True)


def test_a_run_that_fails_still_records_its_lineage_and_config_in_mlflow(base, tmp_path, monkeypatch):
    from training_core.errors import ConfigError
    from training_core.train.ray_trainer import HEALTH_CHECK_INTERVAL_ENV

    datasets = [_dataset(base, tmp_path, "2026-11-01", base.digest)]
    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    # Refused in the driver after the MLflow run started (as a trainer is set up): no Ray needed to fail a run.
    config = TrainingConfig(max_steps=20)
    monkeypatch.setenv(HEALTH_CHECK_INTERVAL_ENV, "fast")
    with pytest.raises(ConfigError, match=f"{HEALTH_CHECK_INTERVAL_ENV}='fast'"):
        run_tracked_training(config, _inputs(base, datasets, ["2026-11-01"]), tracking,
                             ray_storage=str(tmp_path / "ray"), models_dir=tmp_path / "models",
                             before_training=lambda: None)
    (run,) = tracking.client.search_runs([tracking.experiment_id])
    assert run.info.status == "FAILED"
    assert {"seed", "data_seed", "dataset_digest", "cache_version", "config_digest", "code_version",
            "version_torch"} <= set(run.data.params)
    assert run.data.params["config_digest"] == config.digest()
    assert {a.path for a in tracking.client.list_artifacts(run.info.run_id)} >= {"training_config.json", "lineage.json"}


def test_the_chaos_hook_is_refused_when_the_run_would_be_reused_and_nothing_would_train(base, tmp_path, monkeypatch):
    """`TESSERA_FAULT_STEP=N tessera demo` on a state folder that already trained the demo reused
    the run: no worker was killed and the chaos check passed without anything having happened."""
    from types import SimpleNamespace

    from training_core import runs
    from training_core.errors import ConfigError
    from training_core.train.fault_injection import FAULT_STEP_ENV

    datasets = [_dataset(base, tmp_path, "2026-11-01", base.digest)]
    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    earlier = SimpleNamespace(mlflow_run_id="0123456789abcdef0123456789abcdef")
    monkeypatch.setattr(runs, "find_reusable_run", lambda tracking, lineage: earlier)

    def train(**kwargs):
        return run_tracked_training(TrainingConfig(max_steps=20), _inputs(base, datasets, ["2026-11-01"]), tracking,
                                    ray_storage=str(tmp_path / "ray"), models_dir=tmp_path / "models",
                                    before_training=lambda: pytest.fail("training started"), **kwargs)

    assert train() is earlier  # without the hook: reused
    monkeypatch.setenv(FAULT_STEP_ENV, "7")
    with pytest.raises(ConfigError, match=rf"{FAULT_STEP_ENV}=7 is set, but inputs, config and code are unchanged since "
                                          rf"MLflow run {earlier.mlflow_run_id}, which would be reused: nothing trains"):
        train()
    monkeypatch.setenv(FAULT_STEP_ENV, "21")  # after the last step: refused whether or not a run is reused
    with pytest.raises(ConfigError, match=rf"{FAULT_STEP_ENV}=21 would never fire: the run stops at max_steps=20"):
        train()
