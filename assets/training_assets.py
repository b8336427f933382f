"""lora_adapter: distributed DeepSpeed + PEFT training on Ray, tracked in MLflow."""


from dataclasses import dataclass, field
from typing import Literal

import dagster as dg
from dagster_ray import RayResource
from pydantic import Field

from assets.backfills import day_added_to_this_backfill
from assets.cache_assets import WarmCache
from assets.data_assets import refuse_days_that_failed_checks
from assets.partitions import DAILY, TRAINING_WINDOW, by_partition
from assets.run_identity import ended_dagster_run_status
from assets.step_start import start_step
from resources import MlflowTracker, RowGroupCache, RunProcess, TesseraStorage
from resources.io_manager import STORED_BEFORE_IT
from resources.ray_cluster import check_cluster_capacity, connect_unless_connected, gpu_available_in_cluster
from training_core.base_model import BaseModelRef
from training_core.data.window import DatasetWindow, window_digest
from training_core.runs import TrainingInputs, run_tracked_training
from training_core.train.config import parse_training_config
from training_core.train.telemetry import STEP_PHASES


@dataclass(frozen=True)
class TrainedModel:
    model_dir: str
    method: str
    mlflow_run_id: str
    base_model: str
    dataset_digest: str
    final_loss: float
    # The base model's digest it trained on; evaluation refuses another base. Values the io manager
    # pickled before it was recorded load with "" (unrecorded): evaluation reads it from the run's lineage.
    base_model_digest: str = field(default="", metadata={STORED_BEFORE_IT: True})


class TrainingRunConfig(dg.Config):
    """Launchpad settings; defaults train the demo task on two CPU workers in about a minute."""

    method: Literal["full", "lora", "qlora"] = Field("lora", description="full fine-tuning, LoRA, or QLoRA (GPU)")
    lora_r: int = Field(16, gt=0, description="LoRA rank")
    lora_alpha: int = Field(32, gt=0, description="LoRA alpha (scale = alpha / r)")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the LoRA path")
    lora_target_modules: list[str] = Field(
        ["all-linear"], description="layers LoRA wraps: ['all-linear'] (every linear layer but the LM head) "
        "or module names, e.g. ['q_proj', 'v_proj']",
    )
    lora_modules_to_save: list[str] = Field(
        ["embed_tokens", "lm_head"],
        description="modules trained in full beside LoRA; the demo base is random, so it needs these. "
        "Use [] for a pretrained base.",
    )
    zero_stage: int = Field(2, description="DeepSpeed ZeRO stage 0-3")
    offload_optimizer: Literal["none", "cpu"] = Field("none", description="ZeRO-Offload of optimizer state")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="bf16 needs a GPU")
    attention: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="attention kernel: PyTorch SDPA, eager, or FlashAttention 2 (GPU and bf16, flash-attn "
        "installed)",
    )
    micro_batch_size: int = Field(8, description="rows per worker per forward pass (micro step)")
    gradient_accumulation_steps: int = Field(1, ge=1, description="micro steps per optimizer step")
    learning_rate: float = Field(3e-3, description="peak learning rate")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("cosine", description="decay after warm-up")
    warmup_steps: int = Field(10, ge=0, description="optimizer steps of linear warm-up from 0")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    gradient_clipping: float = Field(1.0, ge=0.0, description="max gradient norm; 0 turns clipping off")
    max_steps: int = Field(120, gt=0, description="optimizer steps; the loader cycles epochs as needed")
    max_epochs: int | None = Field(None, gt=0, description="stop earlier after this many epochs")
    checkpoint_every_steps: int = Field(
        50, gt=0, description="optimizer steps between checkpoints (a restarted worker group resumes from the last)",
    )
    num_workers: int = Field(2, gt=0, description="Ray Train workers")
    cpus_per_worker: int = Field(1, gt=0, description="CPUs Ray reserves for each worker")
    loader_workers: int = Field(1, gt=0, description="row-group decode threads per Ray worker (order is unchanged)")
    shuffle_buffer_row_groups: int = Field(4, gt=0, description="row groups held in memory for the final seeded shuffle")
    use_gpu: bool = Field(False, description="one GPU per Ray worker; bf16 and QLoRA need it")
    peak_flops_preset: Literal["auto", "cpu", "a100", "h100", "h200"] = Field(
        "auto", description="peak FLOP/s for the logged MFU: 'auto' reads the GPU's name; CPU runs log achieved "
        "FLOP/s only",
    )
    seed: int = Field(0, description="model init / LoRA / dropout seed")
    data_seed: int = Field(0, description="data order seed")

    def training_config(self):
        values = self.model_dump()
        targets = values.pop("lora_target_modules")
        lora = {"r": values.pop("lora_r"), "alpha": values.pop("lora_alpha"), "dropout": values.pop("lora_dropout"),
                # PEFT's keyword is the string; a list naming it would be read as a module called "all-linear".
                "target_modules": "all-linear" if targets == ["all-linear"] else targets,
                "modules_to_save": values.pop("lora_modules_to_save") or None}
        return parse_training_config({**values, "lora": lora})


@dg.asset(
    partitions_def=DAILY,
    group_name="training",
    kinds={"ray", "deepspeed"},
    pool="training",
    output_required=False,  # a day Dagster added to a backfill ends without output (assets/backfills.py)
    ins={"training_dataset": dg.AssetIn(partition_mapping=TRAINING_WINDOW),
         "row_group_cache": dg.AssetIn(partition_mapping=TRAINING_WINDOW)},
)
def lora_adapter(
    context: dg.AssetExecutionContext,
    config: TrainingRunConfig,
    ray_cluster: RayResource,
    storage: TesseraStorage,
    mlflow_tracker: MlflowTracker,
    cache: RowGroupCache,
    run_process: RunProcess,  # tags the run before this step waits for the training pool's slot
    training_dataset,
    row_group_cache,
    base_model: BaseModelRef,
):
    """Fine-tunes the base model on the datasets of the training window (TRAINING_WINDOW_DAYS days
    ending at this partition), reading batches through the warmed row-group cache.
    When dataset, base model, config and code are unchanged since a finished run, that run is reused."""
    start_step(context)
    if added := day_added_to_this_backfill(context):  # a whole-graph asset backfill adds the day after its range
        context.log.warning(added)
        return  # no output: the day's earlier model stands; evaluation and promoted_model are skipped
    training_config = config.training_config()
    tracker = mlflow_tracker.client()
    window = DatasetWindow.from_partitions(by_partition(training_dataset, context, "training_dataset"))
    caches: dict[str, WarmCache] = by_partition(row_group_cache, context, "row_group_cache")
    refuse_days_that_failed_checks(window.failed_checks(), "lora_adapter")
    if stale := window.stale_caches({day: warm.cache_version for day, warm in caches.items()}):
        raise dg.Failure(
            f"row_group_cache of {', '.join(stale)} was warmed for an earlier materialization of that day's "
            f"training_dataset; rematerialize row_group_cache for {', '.join(stale)} (the run would otherwise "
            "record a cache version no reproduction can rebuild)"
        )
    context.log.info("training window: partitions %s", ", ".join(window.partition_keys))
    inputs = TrainingInputs(
        base_model=base_model.name_or_path,
        base_model_digest=base_model.digest,
        dataset_paths=window.paths,
        dataset_digest=window.digest,
        seq_len=window.seq_len,
        cache_directory=caches[window.partition_keys[-1]].directory,
        cache_size_limit_bytes=cache.size_limit_bytes,  # read under the quota and policy it was warmed with
        cache_policy=cache.policy,
        cache_version=window_digest([caches[k].cache_version for k in window.partition_keys]),
        partition_keys=window.partition_keys,
    )
    tracked = run_tracked_training(
        training_config, inputs, tracker, ray_storage=storage.ray_storage, models_dir=storage.folder("models") / "trained",
        dagster_run_id=context.run_id, extra_tags={"dagster_partition": context.partition_key},
        before_training=lambda: _connect_and_check(ray_cluster, context, training_config),
        base_digest_records=storage.base_model_digests,
        run_has_ended=ended_dagster_run_status(context.instance, context.run_id),
    )
    result = tracked.result
    losses = [loss for _, loss in result.loss_history]
    telemetry = result.telemetry
    lookups = telemetry.get("loader_cache_hits", 0) + telemetry.get("loader_cache_misses", 0)
    yield dg.Output(
        TrainedModel(result.model_dir, training_config.method, tracked.mlflow_run_id, base_model.name_or_path,
                     window.digest, losses[-1], base_model_digest=base_model.digest),
        metadata={
            "mlflow_run": dg.MetadataValue.url(tracker.run_url(tracked.mlflow_run_id, mlflow_tracker.ui_url)),
            "mlflow_run_id": tracked.mlflow_run_id,
            "training_partitions": ", ".join(window.partition_keys),
            "model_dir": dg.MetadataValue.path(result.model_dir),
            "steps": result.steps,
            "restarts": result.restarts,
            "reused_earlier_run": tracked.reused,
            "first_loss": losses[0],
            "final_loss": losses[-1],
            "tokens_per_s": telemetry.get("tokens_per_s", 0.0),  # over training time: checkpoints excluded
            "checkpoint_s": telemetry.get("checkpoint_s", 0.0),
            "data_stall_fraction": telemetry.get("data_stall_fraction", 0.0),
            "cache_hit_rate": telemetry.get("loader_cache_hits", 0) / lookups if lookups else 0.0,
            "mfu": telemetry.get("mfu", 0.0),
            "peak_memory_mb": telemetry.get("peak_memory_mb", 0.0),
            **{f"step_time_{phase}_s": telemetry.get(f"{phase}_s", 0.0)
               for phase in STEP_PHASES},
            **{f"step_time_{phase}_blocked_s": telemetry.get(f"{phase}_blocked_s", 0.0)
               for phase in ("backward", "optimizer")},
            "time_to_first_step_s": telemetry.get("time_to_first_step_s", 0.0),
            "achieved_flops_per_s": telemetry.get("achieved_flops_per_s", 0.0),
            "loss_curve": dg.MetadataValue.md(_sparkline_table(result.loss_history)),
        },
        # The MLflow run is the model: a reused run keeps its version, so evaluation stays fresh.
        data_version=dg.DataVersion(tracked.mlflow_run_id),
    )


def _connect_and_check(ray_cluster: RayResource, context: dg.AssetExecutionContext, training_config) -> None:
    """Ray starts (or is reached) only when training runs; then GPU-only settings and the worker
    group's size are checked against the cluster, before any worker starts."""
    connect_unless_connected(ray_cluster, context)
    training_config.check_hardware(gpu_available_in_cluster())
    check_cluster_capacity(training_config, ray_cluster, context.log)


def _sparkline_table(history: list[tuple[int, float]], rows: int = 8) -> str:
    stride = max(1, len(history) // rows)
    lines = ["| step | loss |", "|---:|---:|"]
    lines += [f"| {step} | {loss:.4f} |" for step, loss in history[::stride]]
    return "\n".join(lines)
