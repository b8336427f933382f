"""Every bad input gets an error naming the file, line or field, and leaves nothing half-written."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import pydantic

from training_core.base_model import resolve_pretrained
from training_core.data.dataset_writer import DatasetSpec, write_dataset
from training_core.errors import ConfigError, EmptyPartitionError, ModelNotFoundError, SourceDataError
from training_core.train.config import TrainingConfig, parse_training_config


def test_empty_partition_leaves_no_dataset(tmp_path, demo_model):
    from training_core.base_model import load_tokenizer

    with pytest.raises(EmptyPartitionError, match="partition 2026-11-05"):
        write_dataset([], load_tokenizer(demo_model.name_or_path), tmp_path, DatasetSpec(), source_label="partition 2026-11-05")
    assert list(tmp_path.iterdir()) == []


def test_example_longer_than_seq_len_leaves_no_partial_dataset(tmp_path, demo_model):
    from training_core.base_model import load_tokenizer

    long = {"prompt": "encode: " + " ".join("abcd" * 30), "response": "a"}
    records = [{"prompt": f"encode: {word}", "response": "b"} for word in "a b c d e".split()] + [long] * 45
    tokenizer = load_tokenizer(demo_model.name_or_path)
    with pytest.raises(SourceDataError, match=r"p: line 6 of raw/records\.jsonl \(prompt 'encode: a b c d a b c d a b c d a b c d '\): "
                                              r"\d+ tokens do not fit seq_len=64"):
        write_dataset(records, tokenizer, tmp_path, DatasetSpec(), source_label="p", records_path="raw/records.jsonl")
    with pytest.raises(SourceDataError, match=r"p: record 5 \(0-based\) \(prompt"):
        write_dataset(records, tokenizer, tmp_path, DatasetSpec(), source_label="p")
    assert [p for p in tmp_path.iterdir()] == []


@pytest.mark.parametrize(("field", "value"), [("rows_per_file", 0), ("row_group_rows", -1), ("seq_len", 2.5),
                                              ("eval_fraction", 1.0), ("max_eval_examples", True)])
def test_dataset_spec_refuses_values_that_cannot_write_a_dataset(field, value):
    with pytest.raises(ConfigError, match=f"DatasetSpec.{field} must be"):
        DatasetSpec(**{field: value})


def test_base_model_path_that_does_not_exist(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no-such-model: no such directory"):
        resolve_pretrained(str(tmp_path / "no-such-model"))
    with pytest.raises(ModelNotFoundError, match="models/team/my-llama: no such directory"):
        resolve_pretrained("models/team/my-llama")  # two slashes: a folder, never sent to the Hub
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="empty: no config.json there"):
        resolve_pretrained(str(tmp_path / "empty"))


def test_base_model_folder_that_transformers_cannot_read_is_named(tmp_path):
    (tmp_path / "notype").mkdir()
    (tmp_path / "notype" / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=r"base model .*notype: cannot be loaded \(.*model_type"):
        resolve_pretrained(str(tmp_path / "notype"))


def test_base_model_under_the_home_folder(demo_model, tmp_path, monkeypatch):
    import shutil

    shutil.copytree(demo_model.name_or_path, tmp_path / "mymodel")
    monkeypatch.setenv("HOME", str(tmp_path))
    ref = resolve_pretrained("~/mymodel")
    assert ref.name_or_path == str(tmp_path / "mymodel") and ref.digest == demo_model.digest


def test_base_model_directory_loads_with_from_pretrained(demo_model):
    ref = resolve_pretrained(demo_model.name_or_path)
    assert ref.digest == demo_model.digest
    assert ref.vocab_size == demo_model.vocab_size


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"micro_batch_size": 0}, "micro_batch_size must be > 0"),
        ({"zero_stage": 4}, "zero_stage must be 0, 1, 2 or 3"),
        ({"learning_rate": -1e-3}, "learning_rate must be a finite number > 0"),
        ({"offload_optimizer": "cpu", "zero_stage": 0}, "needs zero_stage >= 1"),
        ({"method": "qlora", "zero_stage": 3}, "qlora with zero_stage=3"),
        ({"precision": "fp16"}, "fp16 is not supported"),
        ({"max_steps": 0}, "max_steps"),
        ({"no_such_field": 1}, "no_such_field"),
        ({"learning_rate": float("inf")}, "learning_rate must be a finite number > 0, got inf"),
        ({"lora": {"target_modules": []}}, "lora.target_modules: .*non-empty list of module names"),
        ({"data_seed": -1}, "data_seed: .*greater than or equal to 0"),  # failed in a worker, in NumPy
        ({"num_workers": 0, "zero_stage": 7, "micro_batch_size": 0},  # every bad field at once
         "(?=.*num_workers)(?=.*zero_stage must be)(?=.*micro_batch_size must be)"),
    ],
)
def test_impossible_training_configs_are_rejected(values, message):
    with pytest.raises(ConfigError, match=message):
        parse_training_config(values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"precision": "bf16"}, "precision='bf16' needs a GPU; set use_gpu=True"),
        ({"attention": "flash_attention_2"}, "flash_attention_2' needs a GPU; set use_gpu=True"),
        ({"method": "qlora"}, "bitsandbytes 4-bit\\) needs a GPU; set use_gpu=True"),
    ],
)
def test_gpu_only_features_without_use_gpu_are_refused_with_the_config(values, message):
    # Impossible on any cluster: refused when the config is built (a Dagster run's first step), not after Ray starts.
    with pytest.raises(ConfigError, match=message):
        parse_training_config(values)
    assert parse_training_config({**values, "use_gpu": True, "zero_stage": 2, "precision": "bf16"}).use_gpu


def test_a_gpu_run_is_refused_where_no_gpu_is_visible():
    with pytest.raises(ConfigError, match="use_gpu=True but no CUDA GPU is visible"):
        TrainingConfig(use_gpu=True).check_hardware(gpu_available=False)


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
    from training_core.train.fault_injection import FAULT_STEP_ENV, fault_step_from_env

    monkeypatch.setenv(FAULT_STEP_ENV, value)
    with pytest.raises(ConfigError, match=f"TESSERA_FAULT_STEP='{value}': expected a training step number"):
        fault_step_from_env()


def test_a_fault_step_after_the_last_step_is_refused_before_any_worker_starts(monkeypatch, tmp_path):
    from training_core.train.fault_injection import FAULT_STEP_ENV
    from training_core.train.launcher import run_training

    monkeypatch.setenv(FAULT_STEP_ENV, "11")
    with pytest.raises(ConfigError, match="TESSERA_FAULT_STEP=11 would never fire: the run stops at max_steps=10"):
        run_training(TrainingConfig(max_steps=10), model_path="unused", train_dirs=[str(tmp_path)], seq_len=64,
                     cache_dir=None, storage_path=tmp_path, run_name="never", output_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["fast", "0", "-1", "inf", "nan"])
def test_a_health_check_interval_that_is_not_positive_seconds_is_refused(monkeypatch, value):
    from training_core.train.ray_trainer import HEALTH_CHECK_INTERVAL_ENV, use_quick_health_checks

    monkeypatch.setenv(HEALTH_CHECK_INTERVAL_ENV, value)
    with pytest.raises(ConfigError, match=f"{HEALTH_CHECK_INTERVAL_ENV}='{value}': expected a number of seconds > 0"):
        use_quick_health_checks()


def test_a_misspelt_preemption_watcher_switch_is_refused_before_a_trainer_starts(monkeypatch):
    from training_core.train.ray_trainer import PREEMPTION_WATCHER_ENV, use_quick_health_checks

    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    monkeypatch.setenv(PREEMPTION_WATCHER_ENV, "of")
    with pytest.raises(ConfigError, match=f"{PREEMPTION_WATCHER_ENV}='of'"):
        use_quick_health_checks()


def test_an_accelerator_the_config_contradicts_is_named_in_a_warning(monkeypatch, caplog):
    from training_core.train.launcher import warn_about_accelerator_env

    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with caplog.at_level("WARNING", logger="training_core.train.launcher"):
        warn_about_accelerator_env(use_gpu=False)
        warn_about_accelerator_env(use_gpu=True)
    assert [r.getMessage() for r in caplog.records] == [
        "DS_ACCELERATOR='cuda' is ignored: this run's config has use_gpu=False, so its workers use 'cpu'"]


def test_fault_step_parses_and_is_off_when_unset(monkeypatch):
    from training_core.train.fault_injection import FAULT_STEP_ENV, fault_step_from_env

    monkeypatch.setenv(FAULT_STEP_ENV, " 12 ")
    assert fault_step_from_env() == 12
    monkeypatch.delenv(FAULT_STEP_ENV)
    assert fault_step_from_env() is None


def test_cli_state_folder_that_is_a_file_is_refused_without_a_traceback(tmp_path, capsys):
    from pipelines.cli import main

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    assert main(["reproduce", "some-run", "--home", str(blocker)]) == 2
    assert f"tessera reproduce: state folder {blocker} is not usable" in capsys.readouterr().err


def test_cli_ray_address_a_resource_refuses_is_named_without_a_traceback(tmp_path):
    import os
    import subprocess
    import sys

    # A fresh process: the code location reads TESSERA_RAY_ADDRESS when it is first imported.
    env = {**os.environ, "TESSERA_RAY_ADDRESS": "head-node"}  # no port
    done = subprocess.run([sys.executable, "-m", "pipelines.cli", "demo", "--home", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "tessera demo: ExternalRayCluster.address: Value error, Ray address 'head-node' (TESSERA_RAY_ADDRESS" in done.stderr
    assert "Traceback" not in done.stderr


def test_cache_sizes_must_be_numbers(tmp_path):
    from training_core.data import CacheConfig

    with pytest.raises(ValueError, match="CacheConfig.size_limit_bytes must be a whole number of bytes, got '1GB'"):
        CacheConfig(tmp_path, "1GB")


def test_a_base_model_path_that_is_a_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="model.safetensors: is a file; expected a directory"):
        resolve_pretrained(str(tmp_path / "model.safetensors"))


def test_demo_json_path_is_checked_before_the_run(tmp_path, capsys):
    from pipelines.cli import main

    assert main(["demo", "--home", str(tmp_path / "home"), "--json", str(tmp_path / "missing" / "x.json")]) == 2
    assert "--json" in capsys.readouterr().err and not (tmp_path / "home").exists()


def test_a_storage_root_that_is_a_file_is_named(tmp_path):
    from resources import TesseraStorage

    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=r"state folder .*afile \(storage.home / TESSERA_HOME\) is not usable"):
        TesseraStorage(home=str(tmp_path / "afile")).folder("datasets")


def test_demo_hidden_size_must_split_into_the_heads():
    from assets.model_assets import BaseModelConfig

    assert BaseModelConfig(demo_hidden_size=64).demo_hidden_size == 64
    for odd_heads in (130, 100):  # 4 heads of 32.5, of 25 (rotary embeddings need an even head size)
        with pytest.raises(Exception, match=rf"demo_hidden_size must be a multiple of 8 .*, got {odd_heads}"):
            BaseModelConfig(demo_hidden_size=odd_heads)
    # torch.manual_seed takes no negative seed and at most 2**64 - 1: refused at launch, naming the field.
    for seed in (-1, 2**64):
        with pytest.raises(pydantic.ValidationError, match="demo_seed"):
            BaseModelConfig(demo_seed=seed)


@pytest.mark.parametrize(("uri", "message"), [
    ("not-a-uri", "expected a URI with scheme sqlite/postgresql"),
    ("127.0.0.1:5000", "expected a URI with scheme"),
    ("sqlite:////nonexistent/dir/mlflow.db", "folder /nonexistent/dir does not exist"),
])
def test_mlflow_tracking_uris_that_would_misread_or_start_empty_are_refused(tmp_path, uri, message, monkeypatch):
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from resources.mlflow_tracker import check_tracking_uri
    from training_core.tracking import MLFLOW_HTTP_BUDGET

    for name, value in MLFLOW_HTTP_BUDGET.items():  # what the check sets for an http URI: restored afterwards
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"mlflow_tracker.tracking_uri '{uri}': {message}"):
        check_tracking_uri(uri)
    server = HTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)  # answers every request, if with a 501
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        for good in (f"http://127.0.0.1:{server.server_address[1]}", f"sqlite:///{tmp_path / 'mlflow.db'}"):
            check_tracking_uri(good)
    finally:
        server.shutdown()
        server.server_close()


def test_a_database_tracking_uri_whose_driver_is_not_installed_names_the_module_not_a_damaged_store():
    import importlib.util

    from resources.mlflow_tracker import check_tracking_uri

    if importlib.util.find_spec("pyodbc") is not None:
        pytest.skip("pyodbc is installed here: SQL Server's driver is not missing")
    with pytest.raises(ConfigError, match=r"^mlflow_tracker.tracking_uri 'mssql://mlflow:\*\*\*@db/mlflow': its database "
                                          r"driver, the Python module 'pyodbc', is not installed here"):
        check_tracking_uri("mssql://mlflow:secret@db/mlflow")
    with pytest.raises(ConfigError, match=r"'postgresql\+nosuchdriver://db/mlflow': no SQLAlchemy driver for it"):
        check_tracking_uri("postgresql+nosuchdriver://db/mlflow")


def test_an_mlflow_server_uri_where_nothing_listens_fails_at_once_not_after_minutes_of_retries(monkeypatch):
    import socket

    from resources import mlflow_tracker
    from resources.mlflow_tracker import check_tracking_uri

    monkeypatch.setattr(mlflow_tracker, "SERVER_CONNECT_TIMEOUT_S", 0.5)  # 30 s in use: a restart passes

    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{closed.getsockname()[1]}"
        with pytest.raises(ConfigError, match=rf"mlflow_tracker.tracking_uri '{uri}': no MLflow server accepted a "
                                              rf"connection at 127.0.0.1:{closed.getsockname()[1]} within 0.5 s \(.*refused"):
            check_tracking_uri(uri)


def test_a_home_folder_given_with_a_tilde_is_the_users_home(monkeypatch, tmp_path):
    from pathlib import Path

    from resources.paths import state_root

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TESSERA_HOME", "~/tessera-state")
    assert state_root(None) == (tmp_path / "tessera-state").resolve()
    assert Path(state_root(None)).is_absolute()


def test_training_rows_longer_than_the_models_positions_are_refused_before_workers_start(demo_model, tmp_path):
    import shutil
    from pathlib import Path

    from training_core.base_model import check_context_length

    limit = json.loads((Path(demo_model.name_or_path) / "config.json").read_text())["max_position_embeddings"]
    check_context_length(demo_model.name_or_path, limit)
    with pytest.raises(ConfigError, match=rf"training rows of seq_len={limit + 1} are longer than base model "
                                          rf".* allows \(max_position_embeddings={limit}\); lower seq_len"):
        check_context_length(demo_model.name_or_path, limit + 1)
    scaled = Path(shutil.copytree(demo_model.name_or_path, tmp_path / "scaled"))
    config = json.loads((scaled / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (scaled / "config.json").write_text(json.dumps(config))
    check_context_length(str(scaled), 2 * limit)  # a deliberate RoPE extension is the user's call


@pytest.mark.parametrize(("first", "second"), [
    (pa.array([1, 2], pa.int32()), pa.array([3, 4], pa.int64())),  # batches from each file: int32, then int64
    (pa.array([0.5, 1.5]), pa.array([3, 4], pa.int64())),
    (pa.array([1, 2], pa.int64()), pa.array(["a", "b"])),  # ints and strings mixed in one object column
    (pa.array([[1], [2]], pa.list_(pa.int32())), pa.array([[3], [4]], pa.list_(pa.int64()))),
])
def test_files_whose_column_types_differ_are_refused_naming_both_files_and_types(tmp_path, first, second):
    from training_core.data import RowGroupReader
    from training_core.data.parquet_files import SourceError

    pq.write_table(pa.table({"id": [0, 1], "x": first}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": [2, 3], "x": second}), tmp_path / "b.parquet")
    first_type, second_type = (str(pq.read_schema(tmp_path / f"{name}.parquet").field("x").type) for name in "ab")
    message = (rf"b\.parquet: column 'x' is {re.escape(second_type)} here but {re.escape(first_type)} "
               rf"in .*a\.parquet; every file must store a column with one type")
    with pytest.raises(SourceError, match=message):
        RowGroupReader(tmp_path)
    with RowGroupReader(tmp_path, columns=["id"], shuffle=False) as reader:  # the other columns agree
        assert np.concatenate([batch["id"] for batch in reader]).tolist() == [0, 1, 2, 3]


def test_files_may_differ_in_what_batches_cannot_tell_apart(tmp_path):
    """Nullability, dictionary encoding, large strings / lists and list field names give the same
    batch columns; an empty file (pandas writes an empty object column as type null) is never read."""
    from training_core.data import RowGroupReader

    pq.write_table(pa.table({"n": pa.array([1, 2], pa.int64()), "s": ["a", "b"], "l": [[1], [2, 3]]},
                            schema=pa.schema([pa.field("n", pa.int64(), nullable=False), ("s", pa.string()),
                                              ("l", pa.list_(pa.int64()))])), tmp_path / "a.parquet")
    pq.write_table(pa.table({"n": pa.array([3], pa.int64()), "s": pa.array(["c"]).dictionary_encode(),
                             "l": pa.array([[4]], pa.large_list(pa.field("element", pa.int64(), nullable=False)))}),
                   tmp_path / "b.parquet")
    pq.write_table(pa.table({"n": pa.array([4], pa.int64()), "s": pa.array(["d"], pa.large_string()),
                             "l": pa.array([[5]], pa.list_(pa.int64()))}), tmp_path / "c.parquet")
    pd.DataFrame({"n": pd.Series([], dtype="int64"), "s": pd.Series([], dtype=object),
                  "l": pd.Series([], dtype=object)}).to_parquet(tmp_path / "d_empty.parquet")
    with RowGroupReader(tmp_path, batch_size=8, shuffle=False) as reader:
        (batch,) = list(reader)
    assert batch["n"].tolist() == [1, 2, 3, 4] and batch["s"].tolist() == ["a", "b", "c", "d"]
    assert [row.tolist() for row in batch["l"]] == [[1], [2, 3], [4], [5]]


def test_a_column_missing_from_a_file_rewritten_after_listing_is_named(tmp_path):
    from training_core.data import RowGroupReader
    from training_core.data.parquet_files import RowGroupReadError

    pq.write_table(pa.table({"x": pa.array(range(10), pa.int64())}), tmp_path / "p0.parquet")
    pq.write_table(pa.table({"x": pa.array(range(10, 20), pa.int64())}), tmp_path / "p1.parquet")
    with RowGroupReader(tmp_path, batch_size=5, shuffle=False, workers=1) as reader:
        pq.write_table(pa.table({"y": pa.array(range(10, 20), pa.int64())}), tmp_path / "p1.parquet")
        with pytest.raises(RowGroupReadError, match=r"p1\.parquet row group 0: no column\(s\) \['x'\] \(it has \[\]\): "
                                                    r"was the file rewritten after the reader listed it"):
            list(reader)
    pq.write_table(pa.table({"x": pa.array(range(10, 20), pa.int64())}), tmp_path / "p1.parquet")
    with RowGroupReader(tmp_path, batch_size=5, shuffle=False, workers=1) as reader:
        pq.write_table(pa.table({"x": pa.array(["a"] * 10)}), tmp_path / "p0.parquet")
        with pytest.raises(RowGroupReadError, match=r"p0\.parquet row group 0: column 'x' is string, listed as int64"):
            list(reader)


def test_a_transform_keeps_the_columns_it_adds_and_must_return_the_same_columns_everywhere(tmp_path):
    """A column added by the transform is part of every batch; one it returns for some row groups
    only is refused by name (it was silently dropped, or failed as a bare KeyError)."""
    from training_core.data import RowGroupReader
    from training_core.data.workers import TransformError

    schema = pa.schema([pa.field("x", pa.int64(), nullable=False)])
    pq.write_table(pa.table({"x": np.arange(40)}, schema=schema), tmp_path / "data.parquet", row_group_size=10)

    def read(transform, version):
        with RowGroupReader(tmp_path / "data.parquet", batch_size=40, shuffle=False, workers=1, transform=transform,
                            transform_version=version) as reader:
            return list(reader)

    (batch,) = read(lambda columns: {**columns, "y": columns["x"] * 2}, "add-y")
    assert batch["y"].tolist() == [2 * x for x in range(40)]

    def add_later(columns):
        return {**columns, "y": columns["x"] * 2} if columns["x"][0] == 20 else columns

    def drop_later(columns):
        return columns if columns["x"][0] == 20 else {**columns, "y": columns["x"] * 2}

    with pytest.raises(TransformError, match=r"data\.parquet row group 2: columns \['x', 'y'\] differ from "
                                             r".*data\.parquet row group 0's \['x'\] \(missing \[\], extra \['y'\]\); "
                                             r"a transform must return the same columns for every row group"):
        read(add_later, "add-later")
    with pytest.raises(TransformError, match=r"row group 2: columns \['x'\] differ .* \(missing \['y'\], extra \[\]\)"):
        read(drop_later, "drop-later")
