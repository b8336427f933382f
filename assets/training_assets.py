"""lora_adapter: distributed DeepSpeed + PEFT training on Ray, tracked in MLflow."""


from dataclasses import dataclass
from typing import Literal

import dagster as dg
from dagster_ray import RayResource
from pydantic import Field

from assets.cache_assets import WarmCache
from assets.partitions import DAILY
from resources import MlflowTracker, RowGroupCache, TesseraStorage
from resources.ray_cluster import gpu_available_in_cluster
from training_core.base_model import BaseModelRef
from training_core.data.dataset_writer import PublishedDataset
from training_core.runs import TrainingInputs, run_tracked_training
from training_core.train.config import parse_training_config


@dataclass(frozen=True)
class TrainedModel:
    model_dir: str
    method: str
    mlflow_run_id: str
    base_model: str
    dataset_digest: str
    final_loss: float


class TrainingRunConfig(dg.Config):
    """Launchpad settings; defaults train the demo task on two CPU workers in about a minute."""

    method: Literal["full", "lora", "qlora"] = Field("lora", description="full fine-tuning, LoRA, or QLoRA (GPU)")
    lora_r: int = Field(16, gt=0, description="LoRA rank")
    lora_alpha: int = Field(32, gt=0, description="LoRA alpha (scale = alpha / r)")
    lora_modules_to_save: list[str] = Field(
        ["embed_tokens", "lm_head"],
        description="modules trained in full beside LoRA; the demo base is random, so it needs these. "
        "Use [] for a pretrained base.",
    )
    zero_stage: int = Field(2, description="DeepSpeed ZeRO stage 0-3")
    offload_optimizer: Literal["none", "cpu"] = Field("none", description="ZeRO-Offload of optimizer state")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="bf16 needs a GPU")
    attention: Literal["sdpa", "eager", "flash_attention_2"] = Field("sdpa")
    micro_batch_size: int = Field(8, description="rows per worker per step")
    gradient_accumulation_steps: int = Field(1, ge=1)
    learning_rate: float = Field(3e-3, description="peak learning rate")
    max_steps: int = Field(120, gt=0)
    checkpoint_every_steps: int = Field(50, gt=0)
    num_workers: int = Field(2, gt=0, description="Ray Train workers")
    cpus_per_worker: int = Field(1, gt=0)
    use_gpu: bool = Field(False)
    seed: int = Field(0, description="model init / LoRA / dropout seed")
    data_seed: int = Field(0, description="data order seed")

    def training_config(self):
        values = self.model_dump()
        lora = {"r": values.pop("lora_r"), "alpha": values.pop("lora_alpha"),
                "modules_to_save": values.pop("lora_modules_to_save") or None}
        return parse_training_config({**values, "lora": lora})


@dg.asset(partitions_def=DAILY, group_name="training", kinds={"ray", "deepspeed"},
          pool="training")
def lora_adapter(
    context: dg.AssetExecutionContext,
    config: TrainingRunConfig,
    ray_cluster: RayResource,
    storage: TesseraStorage,
    mlflow_tracker: MlflowTracker,
    cache: RowGroupCache,
    training_dataset: PublishedDataset,
    row_group_cache: WarmCache,
    base_model: BaseModelRef,
):
    """Fine-tunes the base model on the day's dataset (batches from the warmed row-group cache).
    When dataset, base model, config and code are unchanged since a finished run, that run is reused."""
    training_config = config.training_config()
    training_config.check_hardware(gpu_available_in_cluster())
    tracker = mlflow_tracker.client()
    inputs = TrainingInputs(
        base_model=base_model.name_or_path,
        base_model_digest=base_model.digest,
        dataset_path=training_dataset.path,
        dataset_digest=training_dataset.digest,
        seq_len=training_dataset.seq_len,
        cache_directory=row_group_cache.directory,
        cache_version=row_group_cache.cache_version,
        partition_keys=[context.partition_key],
    )
    tracked = run_tracked_training(
        training_config, inputs, tracker, ray_storage=storage.ray_storage, models_dir=storage.folder("models") / "trained",
        dagster_run_id=context.run_id, extra_tags={"dagster_partition": context.partition_key},
    )
    result = tracked.result
    losses = [loss for _, loss in result.loss_history]
    telemetry = result.telemetry
    lookups = telemetry.get("loader_cache_hits", 0) + telemetry.get("loader_cache_misses", 0)
    return dg.Output(
        TrainedModel(result.model_dir, training_config.method, tracked.mlflow_run_id, base_model.name_or_path,
                     training_dataset.digest, losses[-1]),
        metadata={
            "mlflow_run": dg.MetadataValue.url(tracker.run_url(tracked.mlflow_run_id, mlflow_tracker.ui_url)),
            "mlflow_run_id": tracked.mlflow_run_id,
            "model_dir": dg.MetadataValue.path(result.model_dir),
            "steps": result.steps,
            "restarts": result.restarts,
            "reused_earlier_run": tracked.reused,
            "first_loss": losses[0],
            "final_loss": losses[-1],
            "tokens_per_s": telemetry.get("tokens_per_s", 0.0),
            "data_stall_fraction": telemetry.get("data_stall_fraction", 0.0),
            "cache_hit_rate": telemetry.get("loader_cache_hits", 0) / lookups if lookups else 0.0,
            "mfu": telemetry.get("mfu", 0.0),
            "peak_memory_mb": telemetry.get("peak_memory_mb", 0.0),
            "achieved_flops_per_s": telemetry.get("achieved_flops_per_s", 0.0),
            "loss_curve": dg.MetadataValue.md(_sparkline_table(result.loss_history)),
        },
    )


def _sparkline_table(history: list[tuple[int, float]], rows: int = 8) -> str:
    stride = max(1, len(history) // rows)
    lines = ["| step | loss |", "|---:|---:|"]
    lines += [f"| {step} | {loss:.4f} |" for step, loss in history[::stride]]
    return "\n".join(lines)
