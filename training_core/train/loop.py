"""The training recipe every Ray Train worker runs, top to bottom:
config → seed → model → DeepSpeed → data → loop → checkpoint → final model.
"""

from __future__ import annotations

import time

_MODULE_IMPORT_STARTED = time.time()  # start-up split: when a Ray worker begins importing the recipe

import contextlib
import functools
import json
import logging
import os
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from training_core.base_model import hub_revision_of_snapshot
from training_core.errors import ConfigError
from training_core.train.batches import EpochBatches
from training_core.train.checkpoint_staging import checkpoint_staging_directory, remove_abandoned_checkpoint_staging
from training_core.train.checkpointing import (
    MODEL_DIR,
    TrainingProgress,
    find_latest_checkpoint,
    load_progress,
    record_run_settings,
    record_worker_group_start,
    restarts_on_resume,
    refuse_changed_settings,
    restore_checkpoint,
    save_checkpoint,
    seal_checkpoint,
    verify_checkpoint_files,
)
from training_core.train.config import TrainingConfig
from training_core.train.deepspeed_config import build_deepspeed_config
from training_core.train.deepspeed_startup import import_deepspeed, skip_unused_deepspeed_startup
from training_core.train.divergence import refuse_diverged_training, trainable_weights_norm
from training_core.train.loss_weighting import check_loss_takes_token_count, loss_to_backpropagate, step_token_count
from training_core.train.model_setup import (
    apply_method, attention_shape, count_matmul_weights, count_parameters, load_base_model, sliding_window,
)
from training_core.train.repeatable_failures import (
    REPEATABLE_ERRORS,
    record_repeatable_failure,
    stop_if_an_earlier_attempt_failed,
)
from training_core.train.schedule import build_lr_scheduler
from training_core.train.telemetry import ModelFlops, StartupClock, StepTimer, resolve_peak_preset
from training_core.train.worker_code import CodeIdentity, refuse_other_code

if TYPE_CHECKING:
    from ray.train import Checkpoint

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
    launched_at: float | None = None  # driver's time.time() at launch, for the start-up split
    # The quota and policy the cache was warmed under (None: batches.DEFAULT_CACHE_SIZE_LIMIT_BYTES):
    # reading with another would evict what warming kept.
    cache_size_limit_bytes: int | None = None
    cache_policy: str = "evict"
    # What a relaunch of this run must train on too (None: model_path, train_dirs).
    base_model_identity: str | None = None
    training_data_identity: list[str] | None = None
    # The code and library versions the driver recorded for this run (CodeIdentity.as_dict()); each
    # worker refuses to train when it runs others. None: not checked.
    recorded_code: dict | None = None

    def trained_on(self) -> tuple[str, list[str]]:
        """(base model, training data) as the relaunch check compares them."""
        return self.base_model_identity or self.model_path, list(self.training_data_identity or self.train_dirs)

    def as_dict(self) -> dict:
        return asdict(self)


# Deprecations inside DeepSpeed's and transformers' own calls, printed by every rank on every ZeRO-3 step
# (40 lines for 40 steps); nothing a Tessera user can act on.
LIBRARY_DEPRECATIONS = (
    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
    r"`is_gradient_checkpointing` is deprecated",
)


def quiet_known_library_warnings() -> None:
    for message in LIBRARY_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


def train_loop_per_worker(loop_config: dict) -> None:
    import ray.train

    inputs = WorkerInputs(**loop_config)
    stop_if_an_earlier_attempt_failed(inputs.run_directory)
    rank = ray.train.get_context().get_world_rank()
    group_starts = None
    if rank == 0 and inputs.run_directory:
        group_starts = record_worker_group_start(Path(inputs.run_directory))
    try:
        _run_recipe(inputs, group_starts)
    except REPEATABLE_ERRORS as error:
        record_repeatable_failure(inputs.run_directory, rank, error)
        raise


def _run_recipe(inputs: WorkerInputs, group_starts: int | None) -> None:
    startup = StartupClock(inputs.launched_at)
    startup.mark("ray_worker_group", at=_MODULE_IMPORT_STARTED)  # Ray Train controller, workers, process group
    startup.mark("recipe_imports")  # torch, transformers, … (pulled in by unpickling this function)
    config = TrainingConfig.model_validate(inputs.config)
    import ray.train

    remove_abandoned_checkpoint_staging()  # of workers on this host killed while checkpointing
    # Before anything is loaded: a worker running other code than the lineage records trains nothing.
    if inputs.recorded_code is not None:
        refuse_other_code(CodeIdentity(**inputs.recorded_code), ray.train.get_context().get_world_rank())
    # Set here rather than through a Ray runtime_env, which costs seconds of worker start-up; from
    # the config, not the inherited environment (the driver warns when that asked for another).
    os.environ["DS_ACCELERATOR"] = "cuda" if config.use_gpu else "cpu"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_known_library_warnings()
    deepspeed = import_deepspeed()  # after DS_ACCELERATOR: DeepSpeed picks its accelerator at import
    skip_unused_deepspeed_startup(config.use_gpu)
    startup.mark("deepspeed_import")

    # Ray already set up torch.distributed; DeepSpeed wraps that group. Needed before ZeRO-3's
    # zero.Init (inside from_pretrained) reads the world size.
    deepspeed.init_distributed(dist_backend="nccl" if config.use_gpu else "gloo")
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    if not config.use_gpu:
        if _node_owns_usable_cores():
            pin_to_own_cores(context.get_local_rank(), context.get_local_world_size(), config.cpus_per_worker)
        torch.set_num_threads(config.cpus_per_worker)
    startup.mark("process_group")

    # Model. Same seed on every rank for init; per-rank seeds only for what follows (dropout).
    ds_config = build_deepspeed_config(config, world_size)
    zero3_keepalive = None
    if config.zero_stage == 3:
        from transformers.integrations.deepspeed import HfDeepSpeedConfig

        zero3_keepalive = HfDeepSpeedConfig(ds_config)  # noqa: F841 — must outlive from_pretrained
    torch.manual_seed(config.seed)
    model = apply_method(load_base_model(config, inputs.model_path), config)
    check_loss_takes_token_count(model)
    total_params, trainable_params = count_parameters(model)
    startup.mark("model_load")
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
    startup.mark("deepspeed_initialize")

    # Resume or start fresh.
    progress, loader_state, resumed_from = _resume(engine, rank, inputs, config, group_starts)
    if loader_state is None:
        torch.manual_seed(config.seed + rank)
    progress.world_size = world_size
    # A fresh start, or an unfinished run from before settings were recorded (it trains on with these);
    # such a finished run was trained with settings nobody knows: it stays without a record.
    if progress.config_digest is None and not progress.finished:
        record_run_settings(progress, config, *inputs.trained_on())

    batches = EpochBatches(inputs, config, rank, world_size, progress.epoch, loader_state)
    startup.mark("resume_and_loader")
    model_flops = ModelFlops(*count_matmul_weights(engine.module), *attention_shape(engine.module.config))
    window = sliding_window(engine.module.config)  # packed rows' masks must hold it: the model takes them as given
    timer = StepTimer(synchronize=torch.cuda.synchronize if config.use_gpu else None)
    already_finished = progress.finished
    unreduced_losses: list[torch.Tensor] = []  # this rank's shares of the step losses since the last report
    skipped_updates: list[bool] = []  # per step since the last report: DeepSpeed skipped its optimizer update
    while progress.step < config.max_steps and not progress.finished:
        # The whole step's micro-batches first: each one's loss is divided by the step's trained tokens.
        with timer.phase("data_wait"):
            micro_batches = [batches.next() for _ in range(config.gradient_accumulation_steps)]
        if None in micro_batches:  # max_epochs reached (on every rank at once: ranks take equal shards)
            progress.finished = True
            break
        with timer.phase("data_wait"):  # a rendezvous: waits for the slowest rank's batches
            step_tokens = step_token_count(micro_batches, world_size, engine.device)
        step_loss = 0.0
        for batch in micro_batches:
            with timer.phase("forward"):
                # loss = summed token loss / step_tokens
                loss = engine(**batches.model_inputs(batch, engine.device, window), num_items_in_batch=step_tokens).loss
            with timer.phase("backward"):
                engine.backward(loss_to_backpropagate(loss, world_size), scale_wrt_gas=False)
            with timer.phase("optimizer"):
                engine.step()  # DeepSpeed steps the optimizer only at accumulation boundaries
            step_loss += loss.detach().float()
            # the examples' tokens and FLOPs, not the rows': padding and attention across examples are no model work
            timer.add_batch(*model_flops.of_packed_rows(batch["labels"].numpy(), batch["position_ids"].numpy()))
        unreduced_losses.append(step_loss)
        # The step's last engine.step() was its accumulation boundary. There ZeRO skips the update of
        # gradients holding inf/NaN, and loss and weights stay finite; a Python bool, no device sync.
        skipped_updates.append(not engine.was_step_applied())
        progress.step += 1
        progress.epoch = batches.epoch
        timer.steps += 1
        _maybe_inject_fault(inputs, progress.step, rank, world_size)
        if progress.step % config.checkpoint_every_steps == 0 and progress.step < config.max_steps:
            with timer.checkpoint():  # checkpoint_s, not training time: tokens/s must not depend on the interval
                _append_mean_losses(progress, unreduced_losses, skipped_updates, engine.module, config)
                _report(engine, rank, progress, batches.state_dict())

    if progress.step == 0 and not already_finished:
        # Only max_epochs ends a run here: its epochs held fewer micro batches than one accumulation.
        raise ConfigError(
            f"max_epochs={config.max_epochs} ended the run before its first optimizer step: rank {rank} got fewer "
            f"than gradient_accumulation_steps={config.gradient_accumulation_steps} micro batches of "
            f"{config.micro_batch_size} rows; raise max_epochs or lower gradient_accumulation_steps"
        )
    if not already_finished:
        # Taken before the final checkpoint, which stores it: that checkpoint is in neither
        # elapsed_s nor checkpoint_s (the driver's wall time around run_training has it).
        gpu_name = torch.cuda.get_device_name() if config.use_gpu and torch.cuda.is_available() else None
        peak_preset = resolve_peak_preset(config.peak_flops_preset, gpu_name)
        progress.telemetry = {**timer.summary(peak_preset, world_size),
                              **{f"loader_{k}": v for k, v in batches.stats().items()},
                              **startup.durations, "time_to_first_step_s": sum(startup.durations.values()),
                              "cpu_cores_visible": len(os.sched_getaffinity(0)),  # 1 per worker when pinned
                              # DeepSpeed's count, kept in its checkpoints: 0, as any skip fails the run
                              "skipped_steps": engine.skipped_steps,
                              "parameters": total_params, "trainable_parameters": trainable_params}
    _append_mean_losses(progress, unreduced_losses, skipped_updates, engine.module, config)
    progress.finished = True
    # The driver reports a finished run it finds without starting workers (launcher.run_training);
    # this covers a run that finished after that check (another launcher of the same run name).
    if already_finished:  # nothing was trained here: report the finished run's model again
        write_model = functools.partial(_copy_finished_model, resumed_from, rank)
    else:
        write_model = functools.partial(_save_final_model, engine, rank=rank)
    _report(engine, rank, progress, batches.state_dict(), write_model=write_model)
    batches.close()


def _node_owns_usable_cores() -> bool:
    """Pin only when this Ray node was given every core the worker can see. Two Ray nodes on one
    host (or a pod whose CPU limit is below its cpuset) would otherwise pin their local rank 0s to
    the same core."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    node_cpus = next((n["Resources"].get("CPU", 0) for n in ray.nodes() if n["NodeID"] == node_id), 0)
    return int(node_cpus) >= len(os.sched_getaffinity(0))


def pin_to_own_cores(local_rank: int, local_world_size: int, cpus_per_worker: int) -> None:
    """CPU training: give each rank on a node its own cores, as CPU launchers (torchrun's
    `--bind`, Intel's) do. Ranks then stop sharing a core when the scheduler moves them, which
    every collective would wait on (2 workers on 2 cores: 14.3 → 13.5 ms/step, measured). Left
    alone when the node has fewer usable cores than its ranks ask for."""
    usable = sorted(os.sched_getaffinity(0))
    first = local_rank * cpus_per_worker
    if local_world_size * cpus_per_worker > len(usable):
        return
    os.sched_setaffinity(0, usable[first : first + cpus_per_worker])


def _append_mean_losses(progress: TrainingProgress, losses: list[torch.Tensor], skipped_updates: list[bool], model,
                        config: TrainingConfig) -> None:
    """Append the steps since the last report to the loss curve. Each rank holds its share of a
    step's loss (its tokens' summed loss over the step's token count): summed over ranks, that is the
    step's per-token mean, the same on every rank. One all-reduce per report instead of one per
    step: a collective costs a rendezvous of all ranks, about a millisecond on CPU with gloo.

    The same all-reduce sums the norms of every rank's trainable weights and the steps whose update
    DeepSpeed skipped (gradients inf or NaN), so a run whose loss, gradients or weights became inf or
    NaN fails here, on every rank at once, before the checkpoint or final model that would keep them.
    (ZeRO all-reduces the gradient norm it skips on, so every rank skips the same steps; summed here,
    a skip on any rank fails them all even so.)"""
    if not losses:
        return
    device = losses[0].device
    gathered = torch.cat([torch.stack(losses), torch.tensor(skipped_updates, dtype=torch.float32, device=device),
                          trainable_weights_norm(model).to(device).reshape(1)])
    torch.distributed.all_reduce(gathered, op=torch.distributed.ReduceOp.SUM)
    values = gathered.tolist()
    step_losses, skip_counts, weights_norm = values[:len(losses)], values[len(losses):-1], values[-1]
    first_step = progress.step - len(losses) + 1
    skipped_steps = [first_step + offset for offset, count in enumerate(skip_counts) if count > 0]
    refuse_diverged_training(first_step, step_losses, weights_norm, progress.step, config, skipped_steps,
                             earlier_losses=progress.loss_history)
    progress.loss_history.extend((first_step + offset, value) for offset, value in enumerate(step_losses))
    losses.clear()
    skipped_updates.clear()


def _latest_checkpoint(inputs: WorkerInputs) -> Checkpoint | Path | None:
    """Ray's latest checkpoint, else the newest complete one on local storage (a worker killed
    right after a report, or a relaunched Dagster run with the same inputs), else None."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None and inputs.run_directory:
        checkpoint = find_latest_checkpoint(Path(inputs.run_directory))
    return checkpoint


@contextlib.contextmanager
def _checkpoint_directory(checkpoint: Checkpoint | Path) -> Iterator[Path]:
    """A local folder with the files of a Ray `Checkpoint` or of a checkpoint folder found on disk."""
    if isinstance(checkpoint, Path):
        yield checkpoint
    else:
        with checkpoint.as_directory() as directory:
            yield Path(directory)


def _resume(
    engine, rank: int, inputs: WorkerInputs, config: TrainingConfig, group_starts: int | None
) -> tuple[TrainingProgress, dict | None, Checkpoint | Path | None]:
    """Restore from the latest checkpoint, if any. Returns (progress, loader_state, the checkpoint
    resumed from or None); a finished run's model is later copied from that checkpoint.

    ``progress.restarts`` counts the starts of the run's worker group after its first: Ray Train's
    restarts and relaunches alike, with or without a checkpoint to resume. ``group_starts``: rank 0's
    count of them, this one included (`record_worker_group_start`); None on the other ranks."""
    earlier_starts = _on_every_rank(group_starts, engine.device) - 1 if inputs.run_directory else 0
    checkpoint = _latest_checkpoint(inputs)
    if checkpoint is None:
        progress = TrainingProgress(restarts=restarts_on_resume(None, earlier_starts))
        if progress.restarts:
            log.warning("rank %d: no checkpoint yet, training from step 0 (restart %d)", rank, progress.restarts)
        return progress, None, None
    with _checkpoint_directory(checkpoint) as directory:
        # The driver checked the checkpoint it expected Ray to hand over; this is the one it did.
        refuse_changed_settings(inputs.run_directory or directory.parent, directory.name, load_progress(directory),
                                config, *inputs.trained_on())
        progress, loader_state = restore_checkpoint(directory, engine, rank)
    progress.restarts = restarts_on_resume(progress, earlier_starts)
    log.warning("rank %d resumed from checkpoint at step %d (restart %d)", rank, progress.step, progress.restarts)
    return progress, loader_state, checkpoint


def _on_every_rank(rank0_value: int | None, device: torch.device) -> int:
    """Rank 0's value on every rank: only rank 0 records the worker group's starts."""
    value = torch.tensor([rank0_value or 0], dtype=torch.int64, device=device)
    torch.distributed.broadcast(value, src=0)
    return int(value.item())


def _report(engine, rank: int, progress: TrainingProgress, loader_state: dict,
            write_model: Callable[[Path], None] | None = None) -> None:
    """Checkpoint and report. Costly (~1 s): called every `checkpoint_every_steps`, never per step.

    With ``write_model`` this is the final checkpoint: it holds the progress and the model, which
    ``write_model`` writes into the folder it is given, but no engine state (nothing resumes a
    finished run)."""
    import ray.train

    with checkpoint_staging_directory() as directory:
        save_checkpoint(directory, engine, rank, progress, loader_state, engine_state=write_model is None)
        if write_model is not None:
            write_model(directory / MODEL_DIR)
        seal_checkpoint(directory, rank)
        metrics = {"step": progress.step, "loss": progress.loss_history[-1][1] if progress.loss_history else None}
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(directory)))


def _copy_finished_model(checkpoint: Checkpoint | Path, rank: int, directory: Path) -> None:
    """A finished run's final checkpoint holds no engine state to save the model from: rank 0
    copies its model folder instead; the other ranks write nothing."""
    if rank == 0:
        with _checkpoint_directory(checkpoint) as source:
            if problems := verify_checkpoint_files(source, only=MODEL_DIR):  # every rank's manifest, too
                raise RuntimeError(f"finished checkpoint {source} is damaged or incomplete, its model is not "
                                   f"reported again: {', '.join(problems)}")
            shutil.copytree(source / MODEL_DIR, directory)


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
        finish_adapter_config(directory)


def finish_adapter_config(directory: Path) -> None:
    """Rewrite what PEFT saved in an adapter folder so that it is repeatable and loads elsewhere.
    PEFT writes target_modules from a Python set, whose order changes with the hash seed: sorted, so
    identical runs produce byte-identical adapter folders. A hub base model is loaded from its snapshot
    folder in this machine's Hugging Face cache, which PEFT names as the base model (in the config and
    the model card): named by repo id and commit instead, as AutoPeftModel and the hub read them."""
    path = directory / "adapter_config.json"
    if not path.exists():
        return
    config = json.loads(path.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    snapshot = config.get("base_model_name_or_path") or ""
    if (hub := hub_revision_of_snapshot(snapshot)) is not None:
        config["base_model_name_or_path"], config["revision"] = hub.repo_id, hub.commit
        card = directory / "README.md"
        if card.is_file():
            card.write_text(card.read_text().replace(snapshot, hub.repo_id))
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
