"""Driver side of a training run: start the Ray Train `TorchTrainer`, wait, collect the result.

Ray must already be initialised (the Dagster Ray resource does it; so does the CLI/tests)."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from training_core.errors import ConfigError
from training_core.train.checkpointing import MODEL_DIR, load_progress
from training_core.train.config import TrainingConfig
from training_core.train.data_preflight import check_training_data
from training_core.train.deepspeed_config import build_deepspeed_config
from training_core.train.loop import WorkerInputs, train_loop_per_worker
from training_core.train.ray_trainer import torch_trainer_class, use_quick_health_checks
from training_core.train.result import TrainingResult

log = logging.getLogger(__name__)

FAULT_STEP_ENV = "TESSERA_FAULT_STEP"


def fault_step_from_env() -> int | None:
    """The chaos hook's step (``TESSERA_FAULT_STEP=N``: kill one worker once at step N), or None
    when unset or empty; anything but a whole number ≥ 1 is refused before any worker starts."""
    raw = os.environ.get(FAULT_STEP_ENV, "").strip()
    if not raw:
        return None
    try:
        step = int(raw)
    except ValueError:
        step = 0
    if step < 1:
        raise ConfigError(f"{FAULT_STEP_ENV}={raw!r}: expected a training step number ≥ 1")
    return step


def run_training(
    config: TrainingConfig,
    *,
    model_path: str,
    train_dirs: list[str],
    seq_len: int,
    cache_dir: str | None,
    storage_path: Path,
    run_name: str,
    output_dir: Path,
    max_failures: int = 2,
) -> TrainingResult:
    """Train on Ray; reruns with the same `run_name` and storage resume from the last checkpoint."""
    import ray.train
    from ray.train.torch import TorchConfig

    fault_step = fault_step_from_env()
    check_training_data(train_dirs, config.micro_batch_size, config.num_workers)  # before any worker starts
    inputs = WorkerInputs(
        config=config.model_dump(mode="json"),
        model_path=model_path,
        train_dirs=list(train_dirs),
        cache_dir=cache_dir,
        seq_len=seq_len,
        fault_step=fault_step,
        fault_marker=str(storage_path / run_name / "fault-injected") if fault_step else None,
        run_directory=str(storage_path / run_name),
        launched_at=time.time(),
    )
    use_quick_health_checks()
    trainer = torch_trainer_class()(
        train_loop_per_worker,
        train_loop_config=inputs.as_dict(),
        torch_config=TorchConfig(backend="nccl" if config.use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(
            num_workers=config.num_workers,
            use_gpu=config.use_gpu,
            resources_per_worker={"CPU": config.cpus_per_worker, **({"GPU": 1} if config.use_gpu else {})},
        ),
        run_config=ray.train.RunConfig(
            name=run_name,
            storage_path=str(storage_path),
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()
    if result.error is not None:
        raise result.error
    if result.checkpoint is None:
        raise RuntimeError(f"training run {run_name} finished without a final checkpoint")
    with result.checkpoint.as_directory() as directory:
        progress = load_progress(Path(directory))
        final_model = output_dir / run_name
        if final_model.exists():
            shutil.rmtree(final_model)
        shutil.copytree(Path(directory) / MODEL_DIR, final_model)
    if progress.restarts:
        log.warning("training run %s resumed from checkpoint %d time(s)", run_name, progress.restarts)
    return TrainingResult(
        run_name=run_name,
        model_dir=str(final_model),
        steps=progress.step,
        restarts=progress.restarts,
        loss_history=progress.loss_history,
        telemetry=progress.telemetry,
        deepspeed_config=build_deepspeed_config(config, config.num_workers),
    )
