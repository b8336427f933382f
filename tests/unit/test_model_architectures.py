"""The driver's checks and the telemetry over architectures other than the demo Llama: tiny models built
from transformers' config classes (on the meta device where only their structure matters)."""
from __future__ import annotations

import pytest
import torch
import transformers

from training_core.base_model import check_context_length
from training_core.errors import ConfigError
from training_core.train.config import TrainingConfig
from training_core.train.model_setup import check_model_before_start

COMMON = dict(vocab_size=500, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, **COMMON)
METHODS = [TrainingConfig(method="full"), TrainingConfig(method="lora")]


@pytest.mark.parametrize("config", METHODS, ids=lambda config: config.method)
@pytest.mark.parametrize(("model_config", "model_type"), [
    (transformers.Gemma2Config(head_dim=16, **LLAMA_LIKE), "gemma2"),  # no sdpa: its logits softcapping
    (transformers.MptConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=64, **COMMON), "mpt"),
])
def test_an_attention_the_model_does_not_support_is_refused_in_the_driver_naming_the_setting(config, model_config,
                                                                                              model_type):
    with pytest.raises(ConfigError, match=rf"^attention='sdpa' \(training config\): base model {model_type} "
                                          rf"\({model_type}, \w+ForCausalLM\) does not support it"):
        check_model_before_start(config, model_config)
    check_model_before_start(config.model_copy(update={"attention": "eager"}), model_config)


def test_flash_attention_is_checked_against_the_model_class_without_flash_attn_in_the_driver():
    # The driver need not hold flash-attn (nor a GPU): the workers do. Only the class's support is checked.
    flash = TrainingConfig(method="full", use_gpu=True, precision="bf16", attention="flash_attention_2")
    check_model_before_start(flash, transformers.LlamaConfig(**LLAMA_LIKE))
    with pytest.raises(ConfigError, match=r"^attention='flash_attention_2' .* \(mpt, MptForCausalLM\) does not support"):
        check_model_before_start(flash, transformers.MptConfig(d_model=64, n_heads=4, n_layers=2, **COMMON))


@pytest.mark.parametrize("config", METHODS, ids=lambda config: config.method)
@pytest.mark.parametrize(("model_config", "model_type"), [
    (transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, **COMMON), "bloom"),
    (transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True, **COMMON),
     "falcon"),
])
def test_alibi_models_that_cannot_take_a_mask_per_example_are_refused(config, model_config, model_type):
    for attention in ("sdpa", "eager"):
        with pytest.raises(ConfigError, match=rf"base model {model_type} \({model_type}\) builds its ALiBi position "
                                              rf"biases from a 2-D padding mask.*rotary or learned positions"):
            check_model_before_start(config.model_copy(update={"attention": attention}), model_config)
    rotary = transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **COMMON)
    check_model_before_start(config, rotary)


def _gemma3(rope_parameters: dict | None = None) -> transformers.Gemma3Config:
    text = dict(head_dim=16, **LLAMA_LIKE)
    if rope_parameters:
        text["rope_parameters"] = rope_parameters
    return transformers.Gemma3Config(text_config=text)


def test_context_length_is_read_from_a_nested_text_config():
    """Gemma 3 from 4B loads as Gemma3ForConditionalGeneration: its positions are in text_config."""
    check_context_length("gemma3", 64, _gemma3())
    with pytest.raises(ConfigError, match=r"seq_len=4096 .* allows \(max_position_embeddings=64\)"):
        check_context_length("gemma3", 4096, _gemma3())
    per_layer_type = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    check_context_length("gemma3", 4096, _gemma3(per_layer_type))  # a deliberate RoPE extension is the user's call


def test_missing_target_modules_are_listed_against_what_lora_can_wrap_conv1d_included():
    """GPT-2's attention and MLP are transformers' Conv1D layers, which LoRA wraps as it wraps nn.Linear."""
    gpt2 = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, **COMMON)
    with pytest.raises(ConfigError, match=r"lora.target_modules \['q_proj'\]: .*\(layers LoRA can wrap: "
                                          r"\['c_attn', 'c_fc', 'c_proj', 'lm_head', 'wpe', 'wte'\]\)"):
        check_model_before_start(TrainingConfig(lora={"target_modules": ["q_proj"]}), gpt2)


def test_moe_flops_count_the_experts_each_token_is_routed_to():
    """transformers 5 stores experts as 3-D parameters, not linear layers; a token runs num_experts_per_tok of them."""
    from tests.unit.flop_support import estimated_over_measured_flops

    config = transformers.MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **LLAMA_LIKE)
    torch.manual_seed(0)
    # experts run one by one (eager): torch's FLOP counter does not count grouped matmuls
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          experts_implementation="eager")
    ratio = estimated_over_measured_flops(model)
    assert 0.98 <= ratio <= 1.02, ratio  # the router's small matmul is left out
