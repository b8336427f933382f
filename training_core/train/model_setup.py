"""Model preparation per method: full fine-tuning, LoRA, or QLoRA (4-bit base, GPU only)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from training_core.errors import ConfigError
from training_core.train.config import TrainingConfig


def _torch_dtype(config: TrainingConfig) -> torch.dtype:
    return torch.bfloat16 if config.precision == "bf16" else torch.float32


def load_base_model(config: TrainingConfig, model_path: str):
    """`from_pretrained` with the configured attention backend and dtype.

    Under ZeRO-3 the caller must keep an `HfDeepSpeedConfig` alive before this call, so that
    transformers partitions parameters while loading instead of materialising them on every rank.
    """
    kwargs: dict = {"dtype": _torch_dtype(config), "attn_implementation": config.attention}
    if config.method == "qlora":
        from transformers import BitsAndBytesConfig  # GPU only; imported lazily

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    return AutoModelForCausalLM.from_pretrained(model_path, **kwargs)


def apply_method(model, config: TrainingConfig):
    """Wrap with PEFT for lora/qlora. Seeded right here: LoRA's A matrices are random, and every
    rank (and every rerun) must start from the same adapter weights."""
    if config.method == "full":
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if config.method == "qlora":
        model = prepare_model_for_kbit_training(model)
    torch.manual_seed(config.seed)
    lora = config.lora
    missing = [name for name in lora.modules_to_save or []
               if not any(module == name or module.endswith(f".{name}") for module, _ in model.named_modules())]
    if missing:  # PEFT would skip them silently: those weights would not train
        raise ConfigError(f"lora.modules_to_save {missing}: no module of that name in the base model "
                          f"(top-level modules: {[name for name, _ in model.named_children()]})")
    peft_config = LoraConfig(
        task_type="CAUSAL_LM",
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        modules_to_save=lora.modules_to_save,
    )
    return get_peft_model(model, peft_config)


def count_parameters(model) -> tuple[int, int]:
    """(total, trainable). Under ZeRO-3 partitioned parameters report their full size via ds_numel."""
    total = trainable = 0
    for parameter in model.parameters():
        numel = getattr(parameter, "ds_numel", parameter.numel())
        total += numel
        if parameter.requires_grad:
            trainable += numel
    return total, trainable
