"""Model preparation per method: full fine-tuning, LoRA, or QLoRA (4-bit base, GPU only)."""

from __future__ import annotations

import re

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
    check_module_names(config, model)
    peft_config = LoraConfig(
        task_type="CAUSAL_LM",
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        modules_to_save=lora.modules_to_save,
    )
    return get_peft_model(model, peft_config)


def check_module_names(config: TrainingConfig, model) -> None:
    """Every module the LoRA settings name exists in ``model``; else a ConfigError naming them and the
    model's top-level modules. PEFT would skip a missing modules_to_save silently (those weights would
    not train) and fail on a missing target module only inside a worker, once per Ray retry."""
    if config.method == "full":
        return
    names = [module for module, _ in model.named_modules()]

    def missing(wanted: list[str]) -> list[str]:
        return [name for name in wanted if not any(module == name or module.endswith(f".{name}") for module in names)]

    top_level = [name for name, _ in model.named_children()]
    if absent := missing(config.lora.modules_to_save or []):
        raise ConfigError(f"lora.modules_to_save {absent}: no module of that name in the base model "
                          f"(top-level modules: {top_level}); for a pretrained base, set it to [] (LoRA only)")
    target = config.lora.target_modules
    linear = sorted({module.rsplit(".", 1)[-1] for module, layer in model.named_modules()
                     if isinstance(layer, torch.nn.Linear)})
    if isinstance(target, list) and (absent := missing(target)):
        raise ConfigError(f"lora.target_modules {absent}: no module of that name in the base model "
                          f"(its linear layers: {linear})")
    if isinstance(target, str) and target != "all-linear":
        # PEFT reads any other string as a regular expression that must match whole module names.
        try:
            pattern = re.compile(target)
        except re.error as error:
            raise ConfigError(f"lora.target_modules {target!r} is neither 'all-linear' nor a valid regular "
                              f"expression ({error})") from None
        if not any(pattern.fullmatch(name) for name in names):
            example = next((name for name in names if linear and name.endswith(f".{linear[0]}")), "")
            raise ConfigError(
                f"lora.target_modules {target!r}: PEFT reads a string other than 'all-linear' as a regular expression "
                f"over full module names (such as {example!r}) and this one matches none; use 'all-linear' or a "
                f"list of names (its linear layers: {linear})"
            )


def check_module_names_before_start(config: TrainingConfig, model_config) -> None:
    """``check_module_names`` in the driver, on the model's skeleton (built on the meta device from its
    config: no weights are read or allocated), before any worker starts."""
    if config.method == "full":
        return
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(model_config)
    check_module_names(config, skeleton)


def _is_unused_copy(name: str) -> bool:
    # PEFT's modules_to_save keeps the frozen original beside the trained copy; only the copy runs.
    return "original_module" in name.split(".")


def count_parameters(model) -> tuple[int, int]:
    """(total, trainable) weights of the model as it trains: under ZeRO-3 partitioned parameters report
    their full size via ds_numel, 4-bit (QLoRA) parameters hold two weights per stored byte, and the
    frozen originals PEFT keeps beside modules_to_save copies are left out."""
    total = trainable = 0
    for name, parameter in model.named_parameters():
        if _is_unused_copy(name):
            continue
        numel = getattr(parameter, "ds_numel", parameter.numel())
        if type(parameter).__name__ == "Params4bit":  # bitsandbytes packs two 4-bit weights per uint8
            numel *= 2
        total += numel
        if parameter.requires_grad:
            trainable += numel
    return total, trainable


def count_matmul_weights(model) -> tuple[int, int]:
    """(frozen, trainable) weights of the linear layers that run in a forward pass, from their shapes
    (right under ZeRO-3 partitioning and 4-bit packing), for the FLOPs of :func:`model_flops_per_token`."""
    frozen = trainable = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or _is_unused_copy(name):
            continue
        weights = module.in_features * module.out_features
        if module.weight.requires_grad:
            trainable += weights
        else:
            frozen += weights
    return frozen, trainable


def attention_shape(model_config) -> tuple[int, int]:
    """(layers, heads × head_dim) of the text model, for the attention term of the FLOPs: head_dim
    need not be hidden_size / heads (Qwen3, Gemma), and multimodal configs nest the text model."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    layers = getattr(text, "num_hidden_layers", 0) or 0
    heads = getattr(text, "num_attention_heads", 0) or 0
    head_dim = getattr(text, "head_dim", None) or (getattr(text, "hidden_size", 0) or 0) // max(heads, 1)
    return layers, heads * head_dim
