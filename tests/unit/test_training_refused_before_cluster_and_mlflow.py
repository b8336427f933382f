"""A training config the driver's Ray-free checks refuse (a micro batch larger than the data, a LoRA
module name the model lacks, seq_len beyond the model's context) is refused before the cluster is
connected or created and before an MLflow run starts: no cluster work, no FAILED run left behind."""

from __future__ import annotations

import re

import pytest

from training_core.errors import ConfigError, SourceDataError
from training_core.runs import TrainingInputs, run_tracked_training
from training_core.tracking import MlflowTracking
from training_core.train.config import TrainingConfig


def _inputs(demo_model, demo_dataset, seq_len: int) -> TrainingInputs:
    return TrainingInputs(base_model=demo_model.name_or_path, base_model_digest=demo_model.digest,
                          dataset_paths=[demo_dataset.path], dataset_digest="window", seq_len=seq_len,
                          cache_directory=None, cache_version="cache", partition_keys=["2026-11-01"])


@pytest.mark.parametrize(("config", "seq_len", "refusal", "message"), [
    (TrainingConfig(micro_batch_size=100_000), 64, SourceDataError,
     r": \d+ training rows, fewer than one micro batch on every worker \(micro_batch_size 100000 × num_workers 2"),
    (TrainingConfig(lora={"target_modules": ["q_prj"]}), 64, ConfigError,
     r"lora.target_modules \['q_prj'\]: no module of that name in the base model"),
    (TrainingConfig(), 4096, ConfigError,
     r"training rows of seq_len=4096 are longer than base model .* allows \(max_position_embeddings=256\)"),
], ids=["micro batch larger than the data", "LoRA target module typo", "seq_len beyond the context"])
def test_a_refused_config_connects_no_cluster_and_records_no_mlflow_run(config, seq_len, refusal, message, demo_model,
                                                                        demo_dataset, tmp_path):
    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    cluster_connections = []  # what the lora_adapter asset's before_training does: connect to / create the cluster
    with pytest.raises(refusal, match=message):
        run_tracked_training(config, _inputs(demo_model, demo_dataset, seq_len), tracking,
                             ray_storage=str(tmp_path / "ray"), models_dir=tmp_path / "models",
                             before_training=lambda: cluster_connections.append("connected"))
    assert cluster_connections == []  # (whether Ray runs depends on earlier tests in this process: not asked)
    assert tracking.client.search_runs([tracking.experiment_id]) == []
    assert not (tmp_path / "ray").exists() and not (tmp_path / "models").exists()


def test_a_config_that_passes_the_checks_connects_before_its_run_starts(demo_model, demo_dataset, tmp_path):
    """The counterpart: the checks passed, the cluster is connected (here: refuses), still no MLflow run."""
    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")

    def cluster_too_small():
        raise ConfigError("the cluster cannot hold 2 workers")

    with pytest.raises(ConfigError, match=re.escape("the cluster cannot hold 2 workers")):
        run_tracked_training(TrainingConfig(), _inputs(demo_model, demo_dataset, 64), tracking,
                             ray_storage=str(tmp_path / "ray"), models_dir=tmp_path / "models",
                             before_training=cluster_too_small)
    assert tracking.client.search_runs([tracking.experiment_id]) == []
