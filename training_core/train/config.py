"""Typed training configuration. Every field has a default a CPU demo can run with; impossible
combinations fail here, before any Ray worker starts, with a message saying why."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from training_core.errors import ConfigError


class LoraSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    r: int = Field(16, gt=0, description="LoRA rank")
    alpha: int = Field(32, gt=0, description="LoRA scaling numerator (scale = alpha / r)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: str | list[str] = Field("all-linear", description="'all-linear' or module names")
    # A randomly initialised base (the demo) has no useful embeddings; real checkpoints leave this empty.
    modules_to_save: list[str] | None = Field(None, description="modules trained in full next to LoRA")

    @field_validator("target_modules")
    @classmethod
    def _some_target(cls, value: str | list[str]) -> str | list[str]:
        if (not value or (isinstance(value, str) and not value.strip())
                or (isinstance(value, list) and not all(name.strip() for name in value))):
            raise ValueError("target_modules must be 'all-linear' or a non-empty list of module names")
        return value

    @field_validator("modules_to_save")
    @classmethod
    def _named_modules(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not all(name.strip() for name in value):
            raise ValueError(f"modules_to_save names must not be blank, got {value}")
        return value


class TrainingConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["full", "lora", "qlora"] = "lora"
    lora: LoraSettings = Field(default_factory=LoraSettings)
    zero_stage: int = Field(2, description="DeepSpeed ZeRO stage 0-3")
    offload_optimizer: Literal["none", "cpu"] = "none"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    attention: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"

    micro_batch_size: int = Field(8, description="rows per worker per forward pass")
    gradient_accumulation_steps: int = Field(1, ge=1)
    learning_rate: float = Field(3e-3, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = Field(10, ge=0)
    gradient_clipping: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    max_steps: int = Field(120, gt=0, description="optimizer steps; the loader cycles epochs as needed")
    max_epochs: int | None = Field(None, gt=0, description="stop earlier after this many epochs")

    # Unused: every step's loss is kept and reported with each checkpoint (ray.train.report costs ~1 s).
    # The field stays so that configs recorded with it still parse, and their digests still match.
    report_every_steps: int = Field(10, gt=0, description="unused (kept for recorded configs): every step's loss is "
                                    "logged, reported to Ray with each checkpoint")
    checkpoint_every_steps: int = Field(50, gt=0)
    seed: int = Field(0, ge=0, description="model/LoRA init and dropout (per rank: seed + rank)")
    data_seed: int = Field(0, ge=0, description="data order (NumPy's generator takes no negative seed)")

    num_workers: int = Field(2, gt=0, description="Ray Train workers (one process each)")
    cpus_per_worker: int = Field(1, gt=0)
    use_gpu: bool = False
    loader_workers: int = Field(1, gt=0, description="decode threads per Ray worker")
    shuffle_buffer_row_groups: int = Field(4, gt=0)
    cache_size_limit_bytes: int = Field(1 << 30, gt=0)
    peak_flops_preset: Literal["auto", "cpu", "a100", "h100", "h200"] = Field(
        "auto", description="peak FLOP/s for MFU: 'auto' reads each worker's GPU name (A100, H100, H200); "
        "'cpu' or an unlisted GPU logs achieved FLOP/s without MFU",
    )

    # One field each, so that every bad field is reported at once (a model validator runs only
    # when all fields are valid).
    @field_validator("micro_batch_size")
    @classmethod
    def _positive_batch(cls, value: int) -> int:
        if value <= 0:
            raise ValueError(f"micro_batch_size must be > 0, got {value}")
        return value

    @field_validator("zero_stage")
    @classmethod
    def _known_stage(cls, value: int) -> int:
        if value not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3 (DeepSpeed ZeRO), got {value}")
        return value

    @field_validator("learning_rate")
    @classmethod
    def _finite_positive_rate(cls, value: float) -> float:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"learning_rate must be a finite number > 0, got {value}")
        return value

    @model_validator(mode="after")
    def _check_values(self) -> "TrainingConfig":
        if self.offload_optimizer == "cpu" and self.zero_stage == 0:
            raise ValueError("offload_optimizer='cpu' needs zero_stage >= 1 (ZeRO-Offload partitions the optimizer)")
        if self.method == "qlora" and self.zero_stage == 3:
            raise ValueError(
                "qlora with zero_stage=3 needs bnb_4bit_quant_storage to match the compute dtype; "
                "use zero_stage 0-2 for QLoRA"
            )
        if self.peak_flops_preset not in ("auto", "cpu") and not self.use_gpu:
            raise ValueError(f"peak_flops_preset={self.peak_flops_preset!r} is a GPU's peak: it needs use_gpu=True "
                             "('auto' picks it from the GPU's name)")
        if self.precision == "fp16":
            raise ValueError("fp16 is not supported: use bf16 on a GPU (no loss scaling needed) or fp32")
        return self

    def check_hardware(self, gpu_available: bool) -> None:
        """Reject GPU-only features when no GPU will run the job."""
        if self.use_gpu and not gpu_available:
            raise ConfigError("use_gpu=True but no CUDA GPU is visible")
        if not self.use_gpu:
            for feature, wanted in (
                ("precision='bf16'", self.precision == "bf16"),
                ("attention='flash_attention_2'", self.attention == "flash_attention_2"),
                ("method='qlora' (bitsandbytes 4-bit)", self.method == "qlora"),
            ):
                if wanted:
                    raise ConfigError(f"{feature} needs a GPU; set use_gpu=True on a GPU cluster")

    def worker_resources(self) -> dict[str, float]:
        """What each Ray Train worker asks for (its ScalingConfig.resources_per_worker)."""
        return {"CPU": self.cpus_per_worker, **({"GPU": 1} if self.use_gpu else {})}

    def capacity_shortfall(self, cluster_resources: dict[str, float]) -> str | None:
        """Why the worker group cannot be placed on a cluster of this total size, or None if it can.
        Ray Train would otherwise wait for the resources and retry its start-up for ever."""
        for resource, per_worker in self.worker_resources().items():
            needed, there = per_worker * self.num_workers, float(cluster_resources.get(resource, 0.0))
            if needed > there:
                return (f"num_workers={self.num_workers} × {per_worker:g} {resource} per worker needs {needed:g} "
                        f"{resource}, and the Ray cluster has {there:g} in all; lower num_workers"
                        f"{' or cpus_per_worker' if resource == 'CPU' else ''}, or train on a larger cluster")
        return None

    @property
    def global_batch_rows(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.num_workers

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def parse_training_config(values: dict) -> TrainingConfig:
    """Build a config from plain values; pydantic's errors become one ConfigError naming the fields."""
    try:
        return TrainingConfig.model_validate(values)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in error.errors()
        )
        raise ConfigError(f"invalid training config: {problems}") from error
