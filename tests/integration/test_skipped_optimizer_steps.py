"""Gradients that overflow while the loss stays finite: DeepSpeed ZeRO skips the optimizer update
(only an "OVERFLOW! Skipping step" line in a worker's log), the weights stay finite too, and the run
used to finish with a flat loss curve, pass the gate and become champion. Now the first skipped step
fails the run, once, naming it; a healthy run records ``skipped_steps`` = 0 in MLflow."""

from __future__ import annotations

from pathlib import Path

import pytest

from training_core.errors import TrainingDivergedError
from training_core.runs import TrainingInputs, run_tracked_training
from training_core.tracking import MlflowTracking
from training_core.train.config import TrainingConfig
from training_core.train.launcher import run_training
from training_core.train.repeatable_failures import RECORD_NAME

pytestmark = pytest.mark.integration


def test_gradients_that_overflow_with_a_finite_loss_fail_the_run_naming_the_step(ray_session, demo_model,
                                                                                  demo_dataset, tmp_path):
    # The audit's settings: scale alpha / r = 6e7 and no clipping. Step 1 trains lora_B away from 0;
    # from step 2 on the gradients are inf while every loss stays finite.
    config = TrainingConfig(lora={"alpha": 10**9}, learning_rate=1.0, gradient_clipping=0.0, lr_schedule="constant",
                            warmup_steps=0, max_steps=4, checkpoint_every_steps=2, num_workers=2)
    with pytest.raises(TrainingDivergedError, match=r"^training diverged: the gradients of step 2 were inf or NaN, "
                                                    r"so DeepSpeed skipped its update \(1 of steps 1-2 skipped, every "
                                                    r"loss finite\); .* lower learning_rate \(now 1\), lower "
                                                    r"lora\.alpha .*turn gradient_clipping on") as failure:
        run_training(config, model_path=demo_model.name_or_path, train_dirs=[str(demo_dataset.train_dir)],
                     seq_len=demo_dataset.seq_len, cache_dir=None, storage_path=tmp_path / "ray", run_name="overflow",
                     output_dir=tmp_path / "models", max_failures=2)
    # Recorded and not retried, as a NaN loss: the same seed and data overflow again.
    assert (tmp_path / "ray" / "overflow" / RECORD_NAME).exists()
    assert "not retried: an earlier attempt of this run failed" in str(failure.value.__cause__)
    assert not [path for path in (tmp_path / "ray" / "overflow").glob("checkpoint_*") if path.is_dir()]
    assert not list((tmp_path / "models").rglob("*.safetensors"))


def test_a_healthy_run_records_no_skipped_steps_in_mlflow(ray_session, demo_model, demo_dataset, tmp_path):
    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    inputs = TrainingInputs(base_model=demo_model.name_or_path, base_model_digest=demo_model.digest,
                            dataset_paths=[demo_dataset.path], dataset_digest="window", seq_len=demo_dataset.seq_len,
                            cache_directory=None, cache_version="cache", partition_keys=["2026-11-01"])
    tracked = run_tracked_training(TrainingConfig(max_steps=3, checkpoint_every_steps=3, warmup_steps=0,
                                                  num_workers=1),
                                   inputs, tracking, ray_storage=str(tmp_path / "ray"), models_dir=tmp_path / "models")
    assert tracked.result.telemetry["skipped_steps"] == 0
    run = tracking.client.get_run(tracked.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["skipped_steps"] == 0.0
    assert Path(tracked.result.model_dir).is_dir()
