"""Models whose forward cannot take the step's token count are refused before training, bare or
wrapped by PEFT (whose own forward takes **kwargs whatever the model under it does)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from training_core.errors import ConfigError
from training_core.train.loss_weighting import check_loss_takes_token_count

TINY = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1)


class NamedArgumentsOnly(LlamaForCausalLM):
    """A model class whose forward names its arguments and takes no **kwargs: num_items_in_batch
    could not reach its loss (transformers leaves `accepts_loss_kwargs` unset on it)."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               labels=labels)


REFUSED = "base model class NamedArgumentsOnly does not take num_items_in_batch in its loss"


def test_a_forward_without_keyword_arguments_is_refused():
    model = NamedArgumentsOnly(TINY)
    assert getattr(model, "accepts_loss_kwargs", True) is not False  # refused for its signature alone
    with pytest.raises(ConfigError, match=REFUSED):
        check_loss_takes_token_count(model)


def test_a_peft_wrapped_model_is_judged_by_the_model_it_wraps():
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear")
    check_loss_takes_token_count(get_peft_model(LlamaForCausalLM(TINY), lora))
    with pytest.raises(ConfigError, match=REFUSED):
        check_loss_takes_token_count(get_peft_model(NamedArgumentsOnly(TINY), lora))
