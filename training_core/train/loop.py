"""The training recipe every Ray Train worker runs, top to bottom:
config → seed → model → DeepSpeed → data → loop → checkpoint → final model.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from training_core.train.batches import EpochBatches
from training_core.train.checkpointing import (
    MODEL_DIR,
    TrainingProgress,
    find_latest_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)
from training_core.train.config import TrainingConfig
from training_core.train.deepspeed_config import build_deepspeed_config
from training_core.train.model_setup import apply_method, count_parameters, load_base_model
from training_core.train.schedule import build_lr_scheduler
from training_core.train.telemetry import StepTimer, model_flops_per_token

log = logging.getLogger("tessera.train")


@dataclass(frozen=True)
class WorkerInputs:
    """Everything a worker needs, as plain values (it crosses process boundaries)."""

    config: dict
    model_path: str
    train_dirs: list[str]  # one per data partition in the training window
    cache_dir: str | None
    seq_len: int
    fault_step: int | None = None  # chaos hook: kill one worker once at this step
    fault_marker: str | None = None  # file that records the fault already happened
    run_directory: str | None = None  # this run's Ray Train storage folder, when local

    def as_dict(self) -> dict:
        return asdict(self)


def train_loop_per_worker(loop_config: dict) -> None:
    inputs = WorkerInputs(**loop_config)
    config = TrainingConfig.model_validate(inputs.config)
    # Set here rather than through a Ray runtime_env, which costs seconds of worker start-up.
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if config.use_gpu else "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import deepspeed  # after DS_ACCELERATOR: DeepSpeed picks its accelerator at import
    import ray.train

    if not config.use_gpu:
        _skip_shm_comm_build()

    # Ray already set up torch.distributed; DeepSpeed wraps that group. Needed before ZeRO-3's
    # zero.Init (inside from_pretrained) reads the world size.
    deepspeed.init_distributed(dist_backend="nccl" if config.use_gpu else "gloo")
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    if not config.use_gpu:
        torch.set_num_threads(config.cpus_per_worker)

    # Model. Same seed on every rank for init; per-rank seeds only for what follows (dropout).
    ds_config = build_deepspeed_config(config, world_size)
    zero3_keepalive = None
    if config.zero_stage == 3:
        from transformers.integrations.deepspeed import HfDeepSpeedConfig

        zero3_keepalive = HfDeepSpeedConfig(ds_config)  # noqa: F841 — must outlive from_pretrained
    torch.manual_seed(config.seed)
    model = apply_method(load_base_model(config, inputs.model_path), config)
    total_params, trainable_params = count_parameters(model)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=config.learning_rate, weight_decay=config.weight_decay
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=build_lr_scheduler(optimizer, config),
        config=ds_config,
        dist_init_required=False,
    )

    # Resume or start fresh.
    progress, loader_state = _resume(engine, rank, inputs)
    if loader_state is None:
        torch.manual_seed(config.seed + rank)
    progress.world_size = world_size

    batches = EpochBatches(inputs, config, rank, world_size, progress.epoch, loader_state)
    hf_config = getattr(engine.module, "config", None)
    flops_per_token = model_flops_per_token(
        total_params,
        trainable_params,
        getattr(hf_config, "num_hidden_layers", 0),
        getattr(hf_config, "hidden_size", 0),
        inputs.seq_len,
    )
    timer = StepTimer()
    already_finished = progress.finished
    while progress.step < config.max_steps and not progress.finished:
        step_loss = 0.0
        for _ in range(config.gradient_accumulation_steps):
            with timer.phase("data_wait"):
                batch = batches.next()
            if batch is None:  # max_epochs reached
                progress.finished = True
                break
            with timer.phase("forward"):
                loss = engine(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            with timer.phase("backward"):
                engine.backward(loss)
            with timer.phase("optimizer"):
                engine.step()  # DeepSpeed steps the optimizer only at accumulation boundaries
            step_loss += loss.detach().float() / config.gradient_accumulation_steps
            timer.tokens += batch["input_ids"].numel()
        if progress.finished:
            break
        # The curve is the mean over ranks, so it does not depend on which rank logs it.
        torch.distributed.all_reduce(step_loss, op=torch.distributed.ReduceOp.SUM)
        progress.step += 1
        progress.epoch = batches.epoch
        timer.steps += 1
        progress.loss_history.append((progress.step, float(step_loss) / world_size))
        _maybe_inject_fault(inputs, progress.step, rank, world_size)
        if progress.step % config.checkpoint_every_steps == 0 and progress.step < config.max_steps:
            _report(engine, rank, progress, batches.state_dict(), final=False)

    if not already_finished:
        progress.telemetry = {**timer.summary(flops_per_token, config.peak_flops_preset, world_size),
                              **{f"loader_{k}": v for k, v in batches.stats().items()},
                              "parameters": total_params, "trainable_parameters": trainable_params}
    progress.finished = True
    _report(engine, rank, progress, batches.state_dict(), final=True)
    batches.close()


def _skip_shm_comm_build() -> None:
    """DeepSpeed's CPU init JIT-compiles a shared-memory all-reduce op that only its inference path
    uses; a different `ninja` on PATH makes it recompile (25-45 s per run, measured). Training on
    CPU goes through gloo, so the build is skipped."""
    import sys

    comm_torch = sys.modules.get("deepspeed.comm.torch")
    if comm_torch is not None and hasattr(comm_torch, "build_shm_op"):
        comm_torch.build_shm_op = lambda: None


def _resume(engine, rank: int, inputs: WorkerInputs) -> tuple[TrainingProgress, dict | None]:
    """Restore from Ray's latest checkpoint, else from the newest complete one on local storage
    (a worker killed right after a report, or a relaunched Dagster run with the same inputs)."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            progress, loader_state = restore_checkpoint(Path(directory), engine, rank)
    else:
        local = find_latest_checkpoint(Path(inputs.run_directory)) if inputs.run_directory else None
        if local is None:
            return TrainingProgress(), None
        progress, loader_state = restore_checkpoint(local, engine, rank)
    if not progress.finished:  # relaunching a finished run is a no-op, not a restart
        progress.restarts += 1
    log.warning("rank %d resumed from checkpoint at step %d (restart %d)", rank, progress.step, progress.restarts)
    return progress, loader_state


def _report(engine, rank: int, progress: TrainingProgress, loader_state: dict, final: bool) -> None:
    """Checkpoint and report. Costly (~1 s): called every `checkpoint_every_steps`, never per step."""
    import ray.train

    with tempfile.TemporaryDirectory(prefix="tessera-ckpt-") as tmp:
        directory = Path(tmp)
        save_checkpoint(directory, engine, rank, progress, loader_state)
        if final:
            _save_final_model(engine, directory / MODEL_DIR, rank)
        metrics = {"step": progress.step, "loss": progress.loss_history[-1][1] if progress.loss_history else None}
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def _save_final_model(engine, directory: Path, rank: int) -> None:
    """Gather before save: under ZeRO-3 each rank holds only a shard of every parameter."""
    import deepspeed

    module = engine.module
    if getattr(engine, "zero_optimization_stage", lambda: 0)() == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            if rank == 0:
                module.save_pretrained(directory)
    elif rank == 0:
        module.save_pretrained(directory)
    if rank == 0:
        _sort_adapter_config(directory / "adapter_config.json")


def _sort_adapter_config(path: Path) -> None:
    """PEFT writes target_modules from a Python set, whose order changes with the hash seed; sort
    it so that identical runs produce byte-identical adapter folders."""
    if not path.exists():
        return
    config = json.loads(path.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True))


def _maybe_inject_fault(inputs: WorkerInputs, step: int, rank: int, world_size: int) -> None:
    """Chaos hook (TESSERA_FAULT_STEP): the last rank dies once, hard, right after `step`."""
    if inputs.fault_step != step or rank != world_size - 1 or not inputs.fault_marker:
        return
    marker = Path(inputs.fault_marker)
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"killed rank {rank} at step {step}\n")
    log.error("TESSERA_FAULT_STEP=%d: killing rank %d", step, rank)
    os._exit(17)
