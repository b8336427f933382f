"""Every bad input gets an error naming the file, line or field, and leaves nothing half-written."""

from __future__ import annotations

import json

import pytest

from training_core.base_model import resolve_pretrained
from training_core.data.dataset_writer import DatasetSpec, write_dataset
from training_core.data.sources import read_records
from training_core.errors import ConfigError, EmptyPartitionError, ModelNotFoundError, SourceDataError
from training_core.train.config import TrainingConfig, parse_training_config


def test_missing_source_path_names_the_path(tmp_path):
    with pytest.raises(SourceDataError, match="does-not-exist.*does not exist"):
        read_records(tmp_path / "does-not-exist")


def test_unreadable_source_file(tmp_path):
    path = tmp_path / "locked.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(SourceDataError, match="locked.jsonl"):
        read_records(path)


def test_jsonl_line_that_is_not_json_names_file_and_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n{not json\n")
    with pytest.raises(SourceDataError, match=r"line 2 of .*a\.jsonl: not valid JSON"):
        read_records(path)


def test_jsonl_line_missing_a_field(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"prompt": "p", "response": "r"}] * 16 + [{"prompt": "p"}]))
    with pytest.raises(SourceDataError, match=r"line 17 of .*a\.jsonl: missing field 'response'"):
        read_records(path)


def test_csv_and_parquet_sources_read(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.csv").write_text("prompt,response\nhello,world\n")
    pq.write_table(pa.table({"prompt": ["x"], "response": ["y"], "extra": [1]}), tmp_path / "b.parquet")
    (tmp_path / "_SUCCESS").write_text("")
    assert read_records(tmp_path) == [{"prompt": "hello", "response": "world"}, {"prompt": "x", "response": "y"}]


def test_parquet_row_with_null_field_names_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["x", "y"], "response": ["z", None]}), tmp_path / "b.parquet")
    with pytest.raises(SourceDataError, match=r"row 1 of .*b\.parquet: missing field 'response'"):
        read_records(tmp_path)


def test_empty_partition_leaves_no_dataset(tmp_path, demo_model):
    from training_core.base_model import load_tokenizer

    with pytest.raises(EmptyPartitionError, match="partition 2026-11-05"):
        write_dataset([], load_tokenizer(demo_model.name_or_path), tmp_path, DatasetSpec(), source_label="partition 2026-11-05")
    assert list(tmp_path.iterdir()) == []


def test_example_longer_than_seq_len_leaves_no_partial_dataset(tmp_path, demo_model):
    from training_core.base_model import load_tokenizer

    records = [{"prompt": "encode: " + " ".join("abcd" * 30), "response": "a"}] * 50
    with pytest.raises(SourceDataError, match="do not fit seq_len=64"):
        write_dataset(records, load_tokenizer(demo_model.name_or_path), tmp_path, DatasetSpec(), source_label="p")
    assert [p for p in tmp_path.iterdir()] == []


def test_base_model_path_that_does_not_exist(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_pretrained(str(tmp_path / "no-such-model"))


def test_base_model_directory_loads_with_from_pretrained(demo_model):
    ref = resolve_pretrained(demo_model.name_or_path)
    assert ref.digest == demo_model.digest
    assert ref.vocab_size == demo_model.vocab_size


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"micro_batch_size": 0}, "micro_batch_size must be > 0"),
        ({"zero_stage": 4}, "zero_stage must be 0, 1, 2 or 3"),
        ({"learning_rate": -1e-3}, "learning_rate must be > 0"),
        ({"offload_optimizer": "cpu", "zero_stage": 0}, "needs zero_stage >= 1"),
        ({"method": "qlora", "zero_stage": 3}, "qlora with zero_stage=3"),
        ({"precision": "fp16"}, "fp16 is not supported"),
        ({"max_steps": 0}, "max_steps"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_impossible_training_configs_are_rejected(values, message):
    with pytest.raises(ConfigError, match=message):
        parse_training_config(values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"precision": "bf16"}, "precision='bf16' needs a GPU"),
        ({"attention": "flash_attention_2"}, "flash_attention_2' needs a GPU"),
        ({"method": "qlora"}, "bitsandbytes 4-bit\\) needs a GPU"),
        ({"use_gpu": True}, "no CUDA GPU is visible"),
    ],
)
def test_gpu_only_features_rejected_without_gpu(values, message):
    config = TrainingConfig(**values)
    with pytest.raises(ConfigError, match=message):
        config.check_hardware(gpu_available=False)


@pytest.mark.parametrize(("value", "expected"), [
    (None, "default"), ("", "default"), ("1", True), ("TRUE", True), (" yes ", True), ("on", True),
    ("0", False), ("false", False), ("No", False), ("off", False),
])
def test_tessera_switches_read_the_same_words_the_same_way(monkeypatch, value, expected):
    from training_core.train.ray_trainer import CLUSTER_SERVICES_ENV, POOLED_PROCESSES_ENV, env_switch

    for name, default in ((CLUSTER_SERVICES_ENV, True), (POOLED_PROCESSES_ENV, False)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        assert env_switch(name, default) is (default if expected == "default" else expected)


def test_a_misspelt_switch_is_refused_with_its_name(monkeypatch):
    from training_core.train.ray_trainer import POOLED_PROCESSES_ENV, env_switch

    monkeypatch.setenv(POOLED_PROCESSES_ENV, "ture")
    with pytest.raises(ConfigError, match=f"{POOLED_PROCESSES_ENV}='ture': expected 1 or 0"):
        env_switch(POOLED_PROCESSES_ENV, default=False)


@pytest.mark.parametrize("value", ["abc", "0", "-3", "2.5", "²"])
def test_a_fault_step_that_is_not_a_step_number_is_refused(monkeypatch, value):
    from training_core.train.launcher import FAULT_STEP_ENV, fault_step_from_env

    monkeypatch.setenv(FAULT_STEP_ENV, value)
    with pytest.raises(ConfigError, match=f"TESSERA_FAULT_STEP='{value}': expected a training step number"):
        fault_step_from_env()


def test_fault_step_parses_and_is_off_when_unset(monkeypatch):
    from training_core.train.launcher import FAULT_STEP_ENV, fault_step_from_env

    monkeypatch.setenv(FAULT_STEP_ENV, " 12 ")
    assert fault_step_from_env() == 12
    monkeypatch.delenv(FAULT_STEP_ENV)
    assert fault_step_from_env() is None
