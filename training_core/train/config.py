"""Typed training configuration. Every field has a default a CPU demo can run with; impossible
combinations fail here, before any Ray worker starts, with a message saying why."""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from training_core.errors import ConfigError


# A worker of rank r seeds torch with seed + r, and torch takes at most 2**64 - 1: the largest signed 64-bit
# integer leaves room for any number of ranks. data_seed needs no bound: NumPy's SeedSequence takes any
# non-negative integer, and the loader passes it in a list ([seed, epoch, ...]), never adds to it.
MAX_SEED = 2**63 - 1
MAX_LEARNING_RATE = 1.0

# Settings this code no longer has, dropped when a config is read so that configs recorded with them
# (MLflow's training_config.json, a checkpoint's progress.json) still parse; digests of recorded
# configs are taken over the JSON as written, so they still verify.
# cache_size_limit_bytes: the loader reads the cache under the quota it was warmed with (the caller's),
# so the config's value was recorded but never used. report_every_steps: every step's loss is kept and
# reported to Ray with each checkpoint (ray.train.report costs ~1 s a call).
RETIRED_SETTINGS = frozenset({"cache_size_limit_bytes", "report_every_steps"})


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
        if isinstance(value, list) and "all-linear" in value:
            raise ValueError(f"target_modules {value}: 'all-linear' stands alone, as the string 'all-linear' "
                             "(in a list PEFT reads it as a module name)")
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
    lora: LoraSettings = Field(default_factory=LoraSettings, description="ignored (left at its defaults) "
                               "under method 'full'")
    zero_stage: int = Field(2, description="DeepSpeed ZeRO stage 0-3")
    offload_optimizer: Literal["none", "cpu"] = "none"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    attention: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"

    micro_batch_size: int = Field(8, description="rows per worker per forward pass")
    gradient_accumulation_steps: int = Field(1, ge=1)
    learning_rate: float = Field(3e-3, description="peak learning rate, at most 1 (pretrained models: about 1e-5 to "
                                 "1e-3)")
    weight_decay: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = Field(10, ge=0)
    gradient_clipping: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    max_steps: int = Field(120, gt=0, description="optimizer steps; the loader cycles epochs as needed")
    max_epochs: int | None = Field(None, gt=0, description="stop earlier after this many epochs")

    checkpoint_every_steps: int = Field(50, gt=0)
    seed: int = Field(0, ge=0, description="model/LoRA init and dropout (per rank: seed + rank); at most 2**63 - 1")
    data_seed: int = Field(0, ge=0, description="data order (NumPy's generator takes no negative seed)")

    num_workers: int = Field(2, gt=0, description="Ray Train workers (one process each)")
    cpus_per_worker: int = Field(1, gt=0)
    use_gpu: bool = False
    loader_workers: int = Field(1, gt=0, description="decode threads per Ray worker")
    shuffle_buffer_row_groups: int = Field(4, gt=0)
    peak_flops_preset: Literal["auto", "cpu", "a100", "h100", "h200"] = Field(
        "auto", description="peak FLOP/s for MFU: 'auto' reads each worker's GPU name (A100, H100, H200); "
        "'cpu' or an unlisted GPU logs achieved FLOP/s without MFU",
    )

    @model_validator(mode="before")
    @classmethod
    def _drop_retired_settings(cls, values: object) -> object:
        """Retired settings are dropped; so are LoRA settings under method 'full', which trains no
        adapter: the config (and its digest, so reuse and resume) must not change with them."""
        if isinstance(values, Mapping):
            return {name: value for name, value in values.items()
                    if name not in RETIRED_SETTINGS and not (name == "lora" and values.get("method") == "full")}
        return values

    # One field each, so that every bad field is reported at once (a model validator runs only
    # when all fields are valid).
    @field_validator("micro_batch_size")
    @classmethod
    def _positive_batch(cls, value: int) -> int:
        if value <= 0:
            raise ValueError(f"micro_batch_size must be > 0, got {value}")
        return value

    @field_validator("seed")
    @classmethod
    def _seed_fits_torch(cls, value: int) -> int:
        if value > MAX_SEED:
            raise ValueError(f"seed must be at most 2**63 - 1 = {MAX_SEED} (each worker seeds torch with "
                             f"seed + rank, and torch takes at most 2**64 - 1), got {value}")
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
        # Above 1 Adam moves every weight by about that much per step: the model is destroyed, not tuned,
        # and the loss settles at chance without any error.
        if value > MAX_LEARNING_RATE:
            raise ValueError(f"learning_rate must be at most {MAX_LEARNING_RATE:g}, got {value:g}; fine-tuning a "
                             "pretrained model uses about 1e-5 to 1e-3 (an exponent left off, such as 5 for 5e-5?)")
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
        # Impossible whatever the cluster holds: refused with the config (a Dagster run's first step),
        # not once Ray is up.
        if not self.use_gpu:
            for feature, wanted in (
                ("precision='bf16'", self.precision == "bf16"),
                ("attention='flash_attention_2'", self.attention == "flash_attention_2"),
                ("method='qlora' (bitsandbytes 4-bit)", self.method == "qlora"),
            ):
                if wanted:
                    raise ValueError(f"{feature} needs a GPU; set use_gpu=True on a GPU cluster")
        if self.attention == "flash_attention_2" and self.precision == "fp32":
            # transformers only warns when loading; the flash-attn kernels then refuse fp32 on every step.
            raise ValueError("attention='flash_attention_2' runs in bf16 only (flash-attn has no fp32 kernels), and "
                             "precision is 'fp32'; set precision='bf16', or attention='sdpa' to train in fp32")
        return self

    def check_hardware(self, gpu_available: bool) -> None:
        """Reject a GPU run where no GPU will run the job (GPU-only features without use_gpu are
        refused when the config is built)."""
        if self.use_gpu and not gpu_available:
            raise ConfigError("use_gpu=True but no CUDA GPU is visible")

    def worker_resources(self) -> dict[str, float]:
        """What each Ray Train worker asks for (its ScalingConfig.resources_per_worker)."""
        return {"CPU": self.cpus_per_worker, **({"GPU": 1} if self.use_gpu else {})}

    def capacity_shortfall(self, nodes: Sequence[Mapping[str, float]]) -> str | None:
        """Why the worker group cannot be placed on Ray nodes with these total resources (one mapping
        per alive node, as ``ray.nodes()`` reports its ``Resources``), or None if it can. Ray Train
        would otherwise wait for the resources and retry its start-up for ever.

        Each worker is one bundle of the trainer's placement group: all its CPUs and GPUs on one node.
        The launcher keeps ScalingConfig's default placement strategy, PACK, which (like SPREAD) lets
        several bundles share a node, so the group fits when the nodes hold ``num_workers`` bundles in
        all. First-fit decreasing placement of identical bundles into the nodes' capacities amounts to
        counting how many fit on each node, and for identical bundles that count is exact (STRICT_PACK
        would need them all on one node; it is not used). Node totals, not what is free now: a busy
        cluster makes training wait, it does not make it impossible."""
        per_worker = self.worker_resources()
        for resource, amount in per_worker.items():
            needed, there = amount * self.num_workers, sum(float(node.get(resource, 0.0)) for node in nodes)
            if needed > there:
                return (f"num_workers={self.num_workers} × {amount:g} {resource} per worker needs {needed:g} "
                        f"{resource}, and the Ray cluster has {there:g} in all; lower num_workers"
                        f"{' or cpus_per_worker' if resource == 'CPU' else ''}, or train on a larger cluster")
        placeable = sum(_workers_that_fit(node, per_worker) for node in nodes)
        if placeable >= self.num_workers:
            return None
        need = _label(_shape(per_worker, per_worker), per_worker)
        # The largest node: the one whose scarcest resource covers the most of a worker.
        largest = max((_shape(node, per_worker) for node in nodes),
                      key=lambda shape: (min(a / b for a, b in zip(shape, per_worker.values())), shape))
        held = "no Ray node holds one" if placeable == 0 else f"the Ray nodes hold only {placeable} of them"
        lower = "cpus_per_worker" if placeable == 0 else "num_workers or cpus_per_worker"
        return (f"num_workers={self.num_workers} × {need} per worker: Ray puts each worker's resources on one node, "
                f"and {held} (the largest node has {_label(largest, per_worker)}; "
                f"{_describe_nodes(nodes, per_worker)}); lower {lower}, or train on larger nodes")

    def digest(self) -> str:
        return config_values_digest(self.model_dump(mode="json"))


def config_values_digest(values: Mapping) -> str:
    """The digest of a config as its JSON values: a recorded config verifies against its digest as
    written, even after this code added fields (re-parsed, they would be filled in)."""
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


def dotted_settings(values: Mapping, prefix: str = "") -> dict[str, object]:
    """A config's JSON values flattened, nested settings named with dots ("lora.r"): how relaunch
    refusals and reproduce drift notes name a setting."""
    flat: dict[str, object] = {}
    for name, value in values.items():
        if isinstance(value, Mapping):
            flat.update(dotted_settings(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _workers_that_fit(node: Mapping[str, float], per_worker: Mapping[str, float]) -> int:
    # Ray keeps resources in fixed point (1e-4): 0.3 GPU × 3 fits 0.9 GPU despite binary floats.
    return min(math.floor(float(node.get(resource, 0.0)) / amount + 1e-6) for resource, amount in per_worker.items())


def _shape(node: Mapping[str, float], keys: Mapping[str, float]) -> tuple[float, ...]:
    return tuple(float(node.get(key, 0.0)) for key in keys)


def _label(shape: tuple[float, ...], keys: Mapping[str, float]) -> str:
    """``2 CPU + 1 GPU``: amounts of the resources a worker asks for."""
    return " + ".join(f"{amount:g} {key}" for amount, key in zip(shape, keys))


def _describe_nodes(nodes: Sequence[Mapping[str, float]], keys: Mapping[str, float], shown: int = 4) -> str:
    """``2 alive nodes have 2 CPU each`` or ``3 alive nodes have 8 CPU + 1 GPU, 2 CPU + 0 GPU (×2)``."""
    shapes = Counter(_shape(node, keys) for node in nodes)
    count = f"{len(nodes)} alive node{'s' if len(nodes) != 1 else ''}"
    if len(shapes) == 1:
        shape = _label(next(iter(shapes)), keys)
        return f"{count} has {shape}" if len(nodes) == 1 else f"{count} have {shape} each"
    largest_first = sorted(shapes, reverse=True)
    listed = ", ".join(_label(shape, keys) + (f" (×{shapes[shape]})" if shapes[shape] > 1 else "")
                       for shape in largest_first[:shown])
    return f"{count} have {listed}{', …' if len(largest_first) > shown else ''}"


def parse_training_config(values: dict) -> TrainingConfig:
    """Build a config from plain values; pydantic's errors become one ConfigError naming the fields."""
    try:
        return TrainingConfig.model_validate(values)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in error.errors()
        )
        raise ConfigError(f"invalid training config: {problems}") from error
