"""Model preparation per method: full fine-tuning, LoRA, or QLoRA (4-bit base, GPU only)."""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Iterator
from typing import NoReturn

import torch
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from training_core.errors import ConfigError
from training_core.train.config import TrainingConfig
from training_core.train.packed_attention import SlidingWindow


def model_dtype(config: TrainingConfig) -> torch.dtype:
    """The dtype the base model is loaded in (and eager attention's additive mask is built in)."""
    return torch.bfloat16 if config.precision == "bf16" else torch.float32


def _packages_needed(config: TrainingConfig) -> Iterator[tuple[str, str, str]]:
    """(setting, package to import, how to install it) for each configured setting that needs a package
    where the model is loaded: on the Ray workers, which may run another image than the driver (whose
    preflight builds a skeleton only, without these packages)."""
    if config.attention == "flash_attention_2":
        yield ("attention='flash_attention_2'", "flash_attn", "flash-attn, built against the workers' CUDA torch "
               "(the Kubernetes image: --build-arg FLASH_ATTN=<version>, docs/scaling_out.md), or set attention='sdpa'")
    if config.method == "qlora":
        yield ("method='qlora'", "bitsandbytes", "the gpu extra on the workers: pip install 'tessera[gpu]' "
               "(the Kubernetes image has it)")


def load_base_model(config: TrainingConfig, model_path: str):
    """`from_pretrained` with the configured attention backend and dtype.

    Under ZeRO-3 the caller must keep an `HfDeepSpeedConfig` alive before this call, so that
    transformers partitions parameters while loading instead of materialising them on every rank.

    A missing package raises ConfigError, which the training run records and Ray does not retry:
    every attempt would load the model on the same image without it.
    """
    for setting, package, install in _packages_needed(config):
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"{setting} (training config) needs the {package} package on every training "
                              f"worker, and this one lacks it; install {install}")
    kwargs: dict = {"dtype": model_dtype(config), "attn_implementation": config.attention}
    if config.method == "qlora":
        from transformers import BitsAndBytesConfig  # GPU only; imported lazily

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    return AutoModelForCausalLM.from_pretrained(model_path, **kwargs)


def sliding_window(model_config) -> SlidingWindow | None:
    """The text model's sliding window, which packed rows' masks must hold too (packed_attention), or
    None where every layer attends in full. transformers' own rule: a model uses ``sliding_window`` when
    it is set (Qwen2/Qwen3-MoE set it to None without use_sliding_window), on the layers that
    ``layer_types`` calls sliding, or on every layer where the config has no ``layer_types``."""
    text = model_config.get_text_config()
    size = getattr(text, "sliding_window", None)
    kinds = set(getattr(text, "layer_types", None) or ["sliding_attention"])
    if not isinstance(size, int) or "sliding_attention" not in kinds:
        return None
    return SlidingWindow(size=size, per_layer_type=len(kinds) > 1)


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


# What PEFT's LoRA can wrap (its default dispatcher). bitsandbytes' 4- and 8-bit layers subclass nn.Linear,
# and on the driver's meta skeleton every linear layer is a plain nn.Linear.
_LORA_LAYERS = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                torch.nn.MultiheadAttention, Conv1D)
# Containers are never called themselves, so PEFT refuses to train one in full in their place.
_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList, torch.nn.ParameterDict)


def check_module_names(config: TrainingConfig, model) -> None:
    """Every module the LoRA settings name exists in ``model`` and is one PEFT can use; else a ConfigError
    naming the field, the modules and what to name instead. PEFT would skip a missing modules_to_save
    silently (those weights would not train), and fail on the others only inside a worker, once per Ray
    retry. The matching is PEFT's (0.21): a list entry picks the modules of that name (exact, or after a
    '.'), any other string than 'all-linear' the modules whose full name it matches; a modules_to_save
    entry picks every module whose name ends with it, and keeps LoRA off those modules and all inside them."""
    if config.method == "full":
        return
    modules = {name: module for name, module in model.named_modules() if name}  # PEFT never wraps the root
    names = list(modules)

    def named(entry: str, name: str) -> bool:
        return name == entry or name.endswith(f".{entry}")

    def missing(wanted: list[str]) -> list[str]:
        return [entry for entry in wanted if not any(named(entry, name) for name in names)]

    saved = config.lora.modules_to_save or []
    top_level = [name for name, _ in model.named_children()]
    if absent := missing(saved):
        raise ConfigError(f"lora.modules_to_save {absent}: no module of that name in the base model "
                          f"(top-level modules: {top_level}); for a pretrained base, set it to [] (LoRA only)")
    copied = [name for name in names if any(name.endswith(entry) for entry in saved)]
    if containers := [name for name in copied if isinstance(modules[name], _CONTAINERS)]:
        raise ConfigError(f"lora.modules_to_save {saved} picks containers, which hold other modules and are never "
                          f"called themselves, so PEFT cannot train them in full: {_described(containers, modules)}; "
                          f"name the modules inside instead")

    target = config.lora.target_modules
    # What LoRA can wrap, as users name it: GPT-2's attention and MLP are Conv1D layers, not nn.Linear.
    wrappable = sorted({name.rsplit(".", 1)[-1] for name, layer in modules.items() if isinstance(layer, _LORA_LAYERS)})
    if isinstance(target, list):
        if absent := missing(target):
            raise ConfigError(f"lora.target_modules {absent}: no module of that name in the base model "
                              f"(layers LoRA can wrap: {wrappable})")
        chosen = [name for name in names if any(named(entry, name) for entry in target)]
    elif target == "all-linear":
        # PEFT leaves out the output layer (lm_head); all the others are linear, so only modules_to_save matters.
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        chosen = [name for name, layer in modules.items() if isinstance(layer, (torch.nn.Linear, Conv1D))
                  and layer is not output]
    else:
        # PEFT reads any other string as a regular expression that must match whole module names.
        try:
            pattern = re.compile(target)
        except re.error as error:
            raise ConfigError(f"lora.target_modules {target!r} is neither 'all-linear' nor a valid regular "
                              f"expression ({error})") from None
        chosen = [name for name in names if pattern.fullmatch(name)]
        if not chosen:
            example = next((name for name in names if wrappable and name.endswith(f".{wrappable[0]}")), "")
            raise ConfigError(
                f"lora.target_modules {target!r}: PEFT reads a string other than 'all-linear' as a regular expression "
                f"over full module names (such as {example!r}) and this one matches none; use 'all-linear' or a "
                f"list of names (layers LoRA can wrap: {wrappable})"
            )

    def kept_whole(name: str) -> bool:  # in modules_to_save, or inside a module that is
        return any(f".{name}.".find(f".{entry}.") >= 0 for entry in saved)

    wrapped = [name for name in chosen if not kept_whole(name)]
    if not wrapped:
        raise ConfigError(f"lora.target_modules {target!r}: every module it selects ({_described(chosen, modules)}) "
                          f"is in or inside lora.modules_to_save {saved}, which PEFT trains in full without LoRA, "
                          f"so LoRA would adapt nothing; target other modules or save fewer")
    eligible = sorted({name.rsplit(".", 1)[-1] for name, layer in modules.items()
                       if isinstance(layer, _LORA_LAYERS) and not kept_whole(name)})
    if unsupported := [name for name in wrapped if not isinstance(modules[name], _LORA_LAYERS)]:
        raise ConfigError(f"lora.target_modules {target!r} selects modules LoRA cannot wrap: "
                          f"{_described(unsupported, modules)}; PEFT's LoRA wraps only Linear, Embedding, Conv1d/2d/3d, "
                          f"Conv1D and MultiheadAttention layers (in this model: {eligible})")
    if clash := sorted(set(copied) & set(wrapped)):
        raise ConfigError(f"lora.modules_to_save {saved} also picks {_described(clash, modules)} (PEFT matches the end "
                          f"of a name, not a whole part), which lora.target_modules gives a LoRA adapter; PEFT "
                          f"cannot do both to one module")


def _described(names: list[str], modules: dict, shown: int = 3) -> str:
    """``model.norm (LlamaRMSNorm), model.layers (ModuleList) and 5 more``."""
    listed = ", ".join(f"{name} ({type(modules[name]).__name__})" for name in names[:shown])
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")


def check_model_before_start(config: TrainingConfig, model_config) -> None:
    """In the driver, before any worker starts (where a failure would repeat once per Ray retry, in
    transformers' or PEFT's words): the model can take packed rows' 4-D masks, its class runs the configured
    ``attention``, and ``check_module_names`` passes, on the model's skeleton (built on the meta device from
    its config: no weights are read or allocated)."""
    _check_takes_a_mask_per_example(model_config)
    check_module_names(config, _skeleton(config, model_config))


def _check_takes_a_mask_per_example(model_config) -> None:
    text = model_config.get_text_config()
    # BLOOM, and Falcon with alibi=True, build their ALiBi biases from the attention mask read as 2-D padding.
    if text.model_type == "bloom" or (text.model_type == "falcon" and getattr(text, "alibi", False)):
        raise ConfigError(
            f"base model {model_config.name_or_path or text.model_type} ({text.model_type}) builds its ALiBi position "
            f"biases from a 2-D padding mask, and packed training rows keep their examples apart with a 4-D mask, "
            f"which it cannot take; use a base model with rotary or learned positions"
        )


def _skeleton(config: TrainingConfig, model_config):
    """The model on the meta device with the configured attention, refused (ConfigError) where its class
    does not support it. For flash_attention_2 only the class's support is checked: the flash-attn package
    is the GPU workers' to have, not the driver's."""
    attention = "eager" if config.attention == "flash_attention_2" else config.attention
    try:
        skeleton = _on_meta(model_config, attention)
    except ValueError as error:
        skeleton = _on_meta(model_config, "eager")  # every model runs eager: a fault of another kind raises here
        _refuse_attention(config, model_config, skeleton, error)
    if config.attention == "flash_attention_2" and not skeleton._supports_flash_attn:
        _refuse_attention(config, model_config, skeleton)
    return skeleton


def _on_meta(model_config, attention: str):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config, attn_implementation=attention)


def _refuse_attention(config: TrainingConfig, model_config, skeleton, cause: Exception | None = None) -> NoReturn:
    import transformers

    model_type = model_config.get_text_config().model_type
    raise ConfigError(
        f"attention={config.attention!r} (training config): base model {model_config.name_or_path or model_type} "
        f"({model_type}, {type(skeleton).__name__}) does not support it in transformers {transformers.__version__}; "
        f"set attention to one it supports ('eager' runs every model)"
    ) from cause


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
    (right under ZeRO-3 partitioning and 4-bit packing), for the FLOPs of `telemetry.ModelFlops`.
    Linear layers are ``torch.nn.Linear`` and transformers' ``Conv1D`` (GPT-2 family: a linear layer
    with its weight stored as (in, out)), and MoE experts: transformers 5 stores a layer's experts as
    3-D parameters (one slice per expert), of which a token runs the ``num_experts_per_tok`` it is
    routed to (every expert where the config names no such count)."""
    routed = getattr(model.config.get_text_config(), "num_experts_per_tok", None)
    frozen = trainable = 0
    for name, module in model.named_modules():
        if _is_unused_copy(name):
            continue
        if isinstance(module, torch.nn.Linear):
            counted = [(module.weight, module.in_features * module.out_features)]
        elif isinstance(module, Conv1D):
            counted = [(module.weight, module.nx * module.nf)]
        elif isinstance(experts := getattr(module, "num_experts", None), int) and experts > 0:
            counted = [(parameter, math.prod(shape) * (routed or experts) // experts)
                       for parameter in module.parameters(recurse=False)
                       if len(shape := getattr(parameter, "ds_shape", parameter.shape)) == 3 and shape[0] == experts]
        else:
            continue
        for parameter, weights in counted:
            if parameter.requires_grad:
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
