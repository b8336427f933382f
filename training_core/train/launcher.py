"""Driver side of a training run: start the Ray Train `TorchTrainer`, wait, collect the result.

Ray must already be initialised (the Dagster Ray resource does it; so does the CLI/tests)."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from training_core.base_model import check_context_length, load_model_config, vocab_size
from training_core.errors import ConfigError
from training_core.storage import directory_digest, replace_directory, staging_directory
from training_core.train.checkpointing import (
    ENGINE_DIR,
    MODEL_DIR,
    TrainingProgress,
    checkpoint_a_relaunch_resumes_from,
    drop_engine_state_of_earlier_checkpoints,
    load_progress,
    refuse_changed_settings,
    remove_checkpoints_ray_does_not_keep,
    set_aside_unusable_ray_snapshot,
    verify_checkpoint_files,
)
from training_core.train.config import TrainingConfig
from training_core.train.data_preflight import base_model_eos_token_ids, check_training_data
from training_core.train.model_setup import check_model_before_start
from training_core.train.deepspeed_config import build_deepspeed_config
from training_core.train.fault_injection import fault_step_for
from training_core.train.loop import WorkerInputs, train_loop_per_worker
from training_core.train.ray_trainer import torch_trainer_class, use_quick_health_checks
from training_core.train.repeatable_failures import clear_repeatable_failure, recorded_repeatable_failure
from training_core.train.result import TrainingResult
from training_core.train.worker_code import CodeIdentity

log = logging.getLogger(__name__)

def warn_about_accelerator_env(use_gpu: bool) -> None:
    """Workers choose DeepSpeed's accelerator from the config (`use_gpu`), whatever
    ``DS_ACCELERATOR`` says in the environment they inherit (a CPU test session sets "cpu"); say
    so when the environment asks for another one, rather than ignoring it silently."""
    wanted = "cuda" if use_gpu else "cpu"
    raw = os.environ.get("DS_ACCELERATOR", "").strip()
    if raw and raw != wanted:
        log.warning("DS_ACCELERATOR=%r is ignored: this run's config has use_gpu=%s, so its workers use %r",
                    raw, use_gpu, wanted)


def warn_about_schedule(config: TrainingConfig) -> None:
    """Settings that run but rarely mean what was wanted (a short smoke run may want them)."""
    if config.warmup_steps > config.max_steps:
        log.warning("warmup_steps=%d > max_steps=%d: the learning rate never reaches learning_rate=%g",
                    config.warmup_steps, config.max_steps, config.learning_rate)
    if config.checkpoint_every_steps >= config.max_steps:
        log.warning("checkpoint_every_steps=%d >= max_steps=%d: no checkpoint before the final one, so a failed "
                    "worker restarts the run from step 0", config.checkpoint_every_steps, config.max_steps)


def check_epochs_hold_an_optimizer_step(config: TrainingConfig, rows: int) -> None:
    """With max_epochs, refuse a run certain to end before its first optimizer step: even a worker
    given every row sees at most floor(rows / micro_batch_size) micro batches per epoch (the reader
    drops the last, partial one)."""
    if config.max_epochs is None:
        return
    most_micro_batches = rows // config.micro_batch_size * config.max_epochs
    if most_micro_batches < config.gradient_accumulation_steps:
        raise ConfigError(
            f"max_epochs={config.max_epochs} over {rows} training rows gives a worker at most {most_micro_batches} "
            f"micro batches of {config.micro_batch_size} rows, fewer than gradient_accumulation_steps="
            f"{config.gradient_accumulation_steps}: not one optimizer step would run; raise max_epochs or lower "
            "gradient_accumulation_steps"
        )


RelaunchPoint = tuple[Path, TrainingProgress]  # the checkpoint a relaunch resumes from, and its progress


def relaunch_point(run_directory: Path) -> RelaunchPoint | None:
    """The checkpoint a relaunch of the run in ``run_directory`` resumes from and its progress, read
    once per launch for the checks below; None for a fresh start, or when its progress cannot be read
    (the workers report an unreadable checkpoint by name)."""
    checkpoint = checkpoint_a_relaunch_resumes_from(run_directory)
    if checkpoint is None:
        return None
    try:
        return checkpoint, load_progress(checkpoint)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def check_relaunch_settings(config: TrainingConfig, run_directory: Path, resumed: RelaunchPoint | None,
                            base_model: str, training_data: list[str]) -> None:
    """Refuse a relaunch under the run name of a run started with other settings: its workers
    would report a finished run's model as this config's, resume an unfinished one with some
    settings restored from the engine state (DeepSpeed restores the learning rate), or fail in
    DeepSpeed on a state laid out for another model (LoRA rank, target modules, method)."""
    if resumed is not None:
        checkpoint, progress = resumed
        refuse_changed_settings(run_directory, checkpoint.name, progress, config, base_model, training_data)


def check_relaunch_world_size(config: TrainingConfig, run_directory: Path, resumed: RelaunchPoint | None) -> None:
    """Refuse a relaunch that would resume an unfinished run at another world size under ZeRO:
    DeepSpeed partitions the optimizer state across the ranks that saved it and refuses it at
    any other world size, in every worker, on every retry. A finished run (its final checkpoint
    holds no engine state) and ZeRO-0 engine state (not partitioned) resume at any world size."""
    if config.zero_stage == 0 or resumed is None:
        return
    checkpoint, progress = resumed
    if progress.finished or progress.world_size == config.num_workers or not (checkpoint / ENGINE_DIR).is_dir():
        return
    raise ConfigError(
        f"run folder {run_directory} holds an unfinished run (checkpoint {checkpoint.name}, step {progress.step}) "
        f"trained by {progress.world_size} worker(s); num_workers={config.num_workers} cannot resume it: ZeRO stage "
        f"{config.zero_stage} partitions the optimizer state across the {progress.world_size} rank(s) that saved it. "
        f"Relaunch with num_workers={progress.world_size} to finish it, or use a new run_name to start over"
    )


def check_before_launch(config: TrainingConfig, *, model_path: str, train_dirs: list[str], seq_len: int) -> None:
    """The driver's checks that need no Ray: the training data (and its rows against the micro
    batch), seq_len against the model's context, the model's attention and LoRA module names.
    Each would otherwise fail inside every worker, once per Ray retry. `run_tracked_training` calls
    it before it connects to Ray or starts an MLflow run; `run_training` calls it unless told so."""
    warn_about_accelerator_env(config.use_gpu)
    warn_about_schedule(config)
    model_config = load_model_config(model_path)
    rows = check_training_data(train_dirs, config.micro_batch_size, config.num_workers, vocab_size(model_config),
                               base_model_eos_token_ids(model_path, model_config))
    check_epochs_hold_an_optimizer_step(config, rows)
    check_context_length(model_path, seq_len, model_config)
    check_model_before_start(config, model_config)


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
    cache_size_limit_bytes: int | None = None,
    cache_policy: str = "evict",
    base_model_identity: str | None = None,
    training_data_identity: list[str] | None = None,
    recorded_code: CodeIdentity | None = None,
    checked_before_launch: bool = False,
) -> TrainingResult:
    """Train on Ray; reruns with the same `run_name` and storage resume from the last checkpoint.
    ``cache_size_limit_bytes`` / ``cache_policy``: those the cache in ``cache_dir`` was warmed with
    (default: ``batches.DEFAULT_CACHE_SIZE_LIMIT_BYTES``, evict). ``base_model_identity`` /
    ``training_data_identity``: what a relaunch of `run_name` must train on too, else it is refused
    (default: ``model_path`` and ``train_dirs``; content digests let a moved folder resume).
    ``recorded_code``: the code and library versions the run's lineage records (default: this
    process's); every worker refuses to train when it runs others. ``checked_before_launch``: the
    caller already ran :func:`check_before_launch` on these arguments."""
    import ray.train
    from ray.train.torch import TorchConfig

    fault_step = fault_step_for(config)
    if not checked_before_launch:
        check_before_launch(config, model_path=model_path, train_dirs=train_dirs, seq_len=seq_len)
    inputs = WorkerInputs(
        config=config.model_dump(mode="json"),
        model_path=model_path,
        train_dirs=list(train_dirs),
        cache_dir=cache_dir,
        cache_size_limit_bytes=cache_size_limit_bytes,
        cache_policy=cache_policy,
        seq_len=seq_len,
        fault_step=fault_step,
        fault_marker=str(storage_path / run_name / "fault-injected") if fault_step else None,
        run_directory=str(storage_path / run_name),
        launched_at=time.time(),
        base_model_identity=base_model_identity,
        training_data_identity=training_data_identity,
        recorded_code=(recorded_code or CodeIdentity.of_this_process()).as_dict(),
    )
    use_quick_health_checks()
    set_aside_unusable_ray_snapshot(storage_path / run_name, ray.__version__)
    # After: both read the list Ray will use.
    resumed = relaunch_point(storage_path / run_name)
    check_relaunch_settings(config, storage_path / run_name, resumed, *inputs.trained_on())
    check_relaunch_world_size(config, storage_path / run_name, resumed)
    if resumed is not None and resumed[1].finished:
        # Its workers would load the model, set up DeepSpeed and copy the model out again: ~20 s of
        # worker start-up per relaunch on two cores, to train nothing. Published from the finished
        # checkpoint, checked against its manifests.
        finished, progress = resumed
        log.info("training run %s finished earlier (%s): its model is reported again, no worker started",
                 run_name, finished.name)
        final_model = publish_final_checkpoint(finished, storage_path / run_name, output_dir / run_name)
        return _training_result(run_name, final_model, progress, config)
    trainer = torch_trainer_class()(
        train_loop_per_worker,
        train_loop_config=inputs.as_dict(),
        torch_config=TorchConfig(backend="nccl" if config.use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(
            num_workers=config.num_workers,
            use_gpu=config.use_gpu,
            resources_per_worker=config.worker_resources(),
        ),
        run_config=ray.train.RunConfig(
            name=run_name,
            storage_path=str(storage_path),
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
        ),
    )
    clear_repeatable_failure(storage_path / run_name)
    try:
        result = trainer.fit()
    except Exception as error:
        if (repeatable := recorded_repeatable_failure(storage_path / run_name)) is not None:
            raise repeatable from error
        raise
    if result.error is not None:
        raise result.error
    if result.checkpoint is None:
        raise RuntimeError(f"training run {run_name} finished without a final checkpoint")
    with result.checkpoint.as_directory() as directory:
        progress = load_progress(Path(directory))
        final_model = publish_final_checkpoint(Path(directory), storage_path / run_name, output_dir / run_name)
    if progress.restarts:
        log.warning("training run %s: its worker group restarted %d time(s)", run_name, progress.restarts)
    return _training_result(run_name, final_model, progress, config)


def _training_result(run_name: str, final_model: Path, progress: TrainingProgress,
                     config: TrainingConfig) -> TrainingResult:
    return TrainingResult(
        run_name=run_name,
        model_dir=str(final_model),
        steps=progress.step,
        restarts=progress.restarts,
        loss_history=progress.loss_history,
        telemetry=progress.telemetry,
        deepspeed_config=build_deepspeed_config(config, config.num_workers),
    )


def publish_final_checkpoint(checkpoint: Path, run_directory: Path, final_model: Path) -> Path:
    """Publish the final checkpoint's model and, only once that succeeded, drop the engine state
    of the run's earlier checkpoints and the checkpoints Ray's list has lost track of: until the
    model is published, a relaunch may resume from them."""
    published = publish_model(checkpoint, final_model)
    drop_engine_state_of_earlier_checkpoints(run_directory, checkpoint)
    remove_checkpoints_ray_does_not_keep(run_directory, checkpoint)
    return published


def publish_model(checkpoint: Path, final_model: Path) -> Path:
    """Copy the final checkpoint's model to `final_model` through a staging folder, after checking
    it against the manifests of every rank its progress.json names: a killed copy, a damaged
    upload or a lost manifest never becomes the model a later run reuses. A model already there
    from an earlier attempt is replaced."""
    if problems := verify_checkpoint_files(checkpoint, only=MODEL_DIR):
        raise RuntimeError(f"final checkpoint {checkpoint} is damaged or incomplete, its model is not published: "
                           f"{', '.join(problems)}")
    with staging_directory(final_model.parent) as staging:
        shutil.copytree(checkpoint / MODEL_DIR, staging / MODEL_DIR)
        directory_digest(staging / MODEL_DIR, record_files=True)
        return replace_directory(staging / MODEL_DIR, final_model)
