"""Training data handed to run_training directly is checked in the driver, naming file and column."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training_core.errors import SourceDataError
from training_core.train.batches import EpochBatches
from training_core.train.config import TrainingConfig
from training_core.train.data_preflight import check_training_data

SEQ = 8


def _tokens(rows: int) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(np.arange(rows * SEQ, dtype=np.int32)), SEQ)


def _write(directory, name: str, **columns) -> None:
    directory.mkdir(exist_ok=True)
    pq.write_table(pa.table(columns), directory / name)


def test_good_data_passes_with_its_row_count(tmp_path):
    _write(tmp_path / "a", "part-0.parquet", input_ids=_tokens(10), labels=_tokens(10))
    _write(tmp_path / "b", "part-0.parquet", input_ids=pa.array([[1, 2]] * 6, pa.list_(pa.int64())),
           labels=pa.array([[1, 2]] * 6, pa.list_(pa.int64())))
    assert check_training_data([str(tmp_path / "a"), str(tmp_path / "b")], micro_batch_size=4, num_workers=2) == 16


@pytest.mark.parametrize(("labels", "message"), [
    (pa.array([[1.0] * SEQ] * 10, pa.list_(pa.float32())), r"column 'labels' is list<element: float>; training needs lists of integer"),
    (pa.array(["1 2 3"] * 10), r"column 'labels' is string; training needs lists of integer"),
    (pa.array([[1] * SEQ] * 9 + [None], pa.list_(pa.int32())), r"column 'labels' holds nulls"),
])
def test_a_file_with_unusable_token_columns_is_named(tmp_path, labels, message):
    _write(tmp_path / "d", "part-0.parquet", input_ids=_tokens(10), labels=_tokens(10))
    _write(tmp_path / "d", "part-1.parquet", input_ids=_tokens(10), labels=labels)
    with pytest.raises(SourceDataError, match=rf"part-1\.parquet: {message}"):
        check_training_data([str(tmp_path / "d")], micro_batch_size=4, num_workers=2)


def test_token_ids_outside_the_base_models_vocabulary_are_named_with_their_row_group(tmp_path):
    ids = pa.array([[1, 2, 3, 4]] * 8 + [[1, 2, 3, 600]] * 8, pa.list_(pa.int32()))
    labels = pa.array([[-100, 2, 3, 4]] * 16, pa.list_(pa.int32()))
    tmp_path.joinpath("d").mkdir()
    pq.write_table(pa.table({"input_ids": ids, "labels": labels}), tmp_path / "d" / "part-0.parquet", row_group_size=8)
    assert check_training_data([str(tmp_path / "d")], 4, 2, vocab_size=601) == 16  # -100 labels are allowed
    with pytest.raises(SourceDataError, match=r"part-0\.parquet: row group 1: column 'input_ids' holds token ids 1\.\.600, "
                                              r"outside the base model's vocabulary \(0\.\.511\); was it tokenized for another"):
        check_training_data([str(tmp_path / "d")], 4, 2, vocab_size=512)
    negative = pa.array([[-1, 2, 3, 4]] * 16, pa.list_(pa.int32()))
    pq.write_table(pa.table({"input_ids": negative, "labels": labels}), tmp_path / "d" / "part-0.parquet")
    with pytest.raises(SourceDataError, match=r"column 'input_ids' holds token ids -1\.\.4"):
        check_training_data([str(tmp_path / "d")], 4, 2, vocab_size=512)


def test_a_missing_column_and_too_few_rows_are_refused(tmp_path):
    _write(tmp_path / "d", "part-0.parquet", input_ids=_tokens(5))
    with pytest.raises(SourceDataError, match=r"part-0\.parquet: no column 'labels'; it has \['input_ids'\]"):
        check_training_data([str(tmp_path / "d")], micro_batch_size=4, num_workers=2)
    _write(tmp_path / "d", "part-0.parquet", input_ids=_tokens(5), labels=_tokens(5))
    with pytest.raises(SourceDataError, match=r"5 training rows, fewer than one micro batch on every worker "
                                              r"\(micro_batch_size 4 × num_workers 2 = 8\)"):
        check_training_data([str(tmp_path / "d")], micro_batch_size=4, num_workers=2)


def test_ragged_rows_stop_training_naming_the_column(tmp_path):
    ragged = pa.array([[1] * SEQ, [1] * (SEQ - 3)] * 8, pa.list_(pa.int32()))
    _write(tmp_path / "d", "part-0.parquet", input_ids=ragged, labels=ragged)
    inputs = SimpleNamespace(train_dirs=[str(tmp_path / "d")], cache_dir=None, cache_size_limit_bytes=None,
                             cache_policy="evict")
    config = TrainingConfig(num_workers=1, micro_batch_size=4, max_steps=10)
    batches = EpochBatches(inputs, config, rank=0, world_size=1, epoch=0, state=None)
    try:
        with pytest.raises(SourceDataError, match=r"column 'input_ids' has rows of different lengths in epoch 0"):
            batches.next()
    finally:
        batches.close()


def _shifted_labels(rows: int) -> pa.Array:  # labels shifted by their writer: one fewer than input_ids
    return pa.FixedSizeListArray.from_arrays(pa.array(np.arange(rows * (SEQ - 1), dtype=np.int32)), SEQ - 1)


def test_labels_narrower_than_input_ids_are_refused_naming_the_file_and_both_widths(tmp_path):
    _write(tmp_path / "d", "part-0.parquet", input_ids=_tokens(10), labels=_tokens(10))
    _write(tmp_path / "d", "part-1.parquet", input_ids=_tokens(10).cast(pa.list_(pa.int32())),
           labels=_shifted_labels(10).cast(pa.list_(pa.int32())))
    with pytest.raises(SourceDataError, match=rf"part-1\.parquet: row 0 holds {SEQ} input_ids but {SEQ - 1} labels; "
                                              r"training needs one label per input token"):
        check_training_data([str(tmp_path / "d")], micro_batch_size=4, num_workers=2)


def test_a_batch_whose_labels_differ_in_width_stops_training_naming_both_widths(tmp_path):
    # Past the preflight's first row: the worker names the data rather than failing inside the loss.
    _write(tmp_path / "d", "part-0.parquet", input_ids=_tokens(8), labels=_shifted_labels(8))
    inputs = SimpleNamespace(train_dirs=[str(tmp_path / "d")], cache_dir=None, cache_size_limit_bytes=None,
                             cache_policy="evict")
    batches = EpochBatches(inputs, TrainingConfig(num_workers=1, micro_batch_size=4, max_steps=10),
                           rank=0, world_size=1, epoch=0, state=None)
    try:
        with pytest.raises(SourceDataError, match=rf"/d: a batch in epoch 0 holds rows of {SEQ} input_ids but "
                                                  rf"{SEQ - 1} labels; training needs one label per input token"):
            batches.next()
    finally:
        batches.close()


@pytest.mark.parametrize(("max_epochs", "accumulation", "refused"), [
    (None, 64, False),  # max_steps alone: the loader cycles epochs
    (1, 2, False),      # 10 rows / 4 per micro batch: 2 micro batches per epoch (the partial third is dropped)
    (1, 3, True),
    (2, 4, False),
])
def test_epochs_too_short_for_one_optimizer_step_are_refused_before_training(max_epochs, accumulation, refused):
    from training_core.errors import ConfigError
    from training_core.train.launcher import check_epochs_hold_an_optimizer_step

    config = TrainingConfig(max_epochs=max_epochs, gradient_accumulation_steps=accumulation, micro_batch_size=4)
    if not refused:
        check_epochs_hold_an_optimizer_step(config, rows=10)
        return
    with pytest.raises(ConfigError, match=r"max_epochs=1 over 10 training rows gives a worker at most 2 micro batches "
                                          r"of 4 rows, fewer than gradient_accumulation_steps=3"):
        check_epochs_hold_an_optimizer_step(config, rows=10)


def test_the_driver_checks_refuse_epochs_too_short_for_one_optimizer_step(demo_model, demo_dataset):
    from training_core.errors import ConfigError
    from training_core.train.launcher import check_before_launch

    config = TrainingConfig(max_epochs=1, micro_batch_size=8, gradient_accumulation_steps=100_000)
    with pytest.raises(ConfigError, match="max_epochs=1 over"):
        check_before_launch(config, model_path=demo_model.name_or_path, train_dirs=[demo_dataset.train_dir],
                            seq_len=demo_dataset.seq_len)


@pytest.mark.parametrize(("values", "warning"), [
    ({"warmup_steps": 10, "max_steps": 5}, "warmup_steps=10 > max_steps=5: the learning rate never reaches"),
    ({"checkpoint_every_steps": 50, "max_steps": 20}, "checkpoint_every_steps=50 >= max_steps=20: no checkpoint before"),
    ({"warmup_steps": 5, "max_steps": 5, "checkpoint_every_steps": 2}, None),
])
def test_schedules_that_rarely_mean_what_was_wanted_are_named_in_a_warning(values, warning, caplog):
    from training_core.train.launcher import warn_about_schedule

    with caplog.at_level("WARNING", logger="training_core.train.launcher"):
        warn_about_schedule(TrainingConfig(**values))
    messages = [record.getMessage() for record in caplog.records]
    if warning is None:
        assert messages == []
    else:
        assert any(warning in message for message in messages), messages


EOS = 2


def test_rows_not_laid_out_as_packed_are_refused_naming_the_file_and_the_row(tmp_path):
    # Another writer's rows, one example a row without eos: training would read the last trained
    # token (21) as the row's eos and cut the response "20 21 20 22 21" after its first 21.
    unpacked = ([1, 10, 11, 20, 21, 20, 22, 21, 0, 0], [-100, -100, -100, 20, 21, 20, 22, 21, -100, -100])
    packed = ([1, 10, 20, 2, 1, 11, 21, 2, 2, 2], [-100, -100, 20, 2, -100, -100, 21, 2, -100, -100])  # pad == eos
    prompt_only = ([1, 10, 11, 12, 0, 0, 0, 0, 0, 0], [-100] * 10)  # trains nothing: skipped
    column = pa.list_(pa.int32())

    def write(name: str, rows: list[tuple[list[int], list[int]]], folder: str = "d") -> None:
        _write(tmp_path / folder, name, input_ids=pa.array([ids for ids, _ in rows], column),
               labels=pa.array([labels for _, labels in rows], column))

    write("part-0.parquet", [prompt_only] * 8, folder="untrained")
    assert check_training_data([str(tmp_path / "untrained")], 4, 2, eos_token_ids={EOS}) == 8
    write("part-0.parquet", [packed, prompt_only] * 4)
    assert check_training_data([str(tmp_path / "d")], 4, 2, eos_token_ids={EOS}) == 8
    write("part-1.parquet", [packed, prompt_only, packed, unpacked] + [packed] * 4)
    with pytest.raises(SourceDataError, match=r"part-1\.parquet: row 3: its last trained token is 21, not the base "
                                              r"model's eos \(2\); training needs rows laid out as Tessera packs them: "
                                              r"examples back to back from the row start, each ending in an eos"):
        check_training_data([str(tmp_path / "d")], 4, 2, eos_token_ids={EOS})
    assert check_training_data([str(tmp_path / "d")], 4, 2, eos_token_ids={EOS, 21}) == 16  # a model with two eos


def test_the_pipelines_own_dataset_passes_with_the_demo_models_eos(demo_model, demo_dataset):
    from training_core.base_model import load_model_config, vocab_size
    from training_core.train.data_preflight import base_model_eos_token_ids

    config = load_model_config(demo_model.name_or_path)
    eos_token_ids = base_model_eos_token_ids(demo_model.name_or_path, config)
    assert eos_token_ids == {EOS}
    assert check_training_data([str(demo_dataset.train_dir)], 4, 2, vocab_size(config), eos_token_ids) == \
        demo_dataset.train_rows


def test_the_base_models_eos_ids_are_read_from_its_config_and_generation_config(tmp_path):
    from transformers import GenerationConfig, LlamaConfig

    from training_core.base_model import load_model_config
    from training_core.train.data_preflight import base_model_eos_token_ids

    LlamaConfig(vocab_size=64, eos_token_id=2).save_pretrained(tmp_path)
    assert base_model_eos_token_ids(str(tmp_path), load_model_config(str(tmp_path))) == {2}  # no tokenizer, no generation config
    GenerationConfig(eos_token_id=[2, 7, 9]).save_pretrained(tmp_path)
    assert base_model_eos_token_ids(str(tmp_path), load_model_config(str(tmp_path))) == {2, 7, 9}
