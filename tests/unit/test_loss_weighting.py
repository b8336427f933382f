"""Token-weighted step loss: how the loop weights each micro-batch's loss, on the real tiny demo model,
with DeepSpeed's arithmetic written out (backward without 1/GAS, gradients averaged over ranks)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from training_core.data.packing import IGNORE_INDEX
from training_core.errors import ConfigError
from training_core.train.loss_weighting import (
    check_loss_takes_token_count, loss_to_backpropagate, step_token_count, trained_token_count,
)


@pytest.fixture
def model(demo_model):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(demo_model.name_or_path, dtype=torch.float32)


def uneven_rows(vocab_size: int) -> dict[str, torch.Tensor]:
    """4 rows of 16 tokens that train 15, 1, 8 and 2 tokens (the first label of a row is never trained)."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, vocab_size, (4, 16), generator=generator)
    labels = input_ids.clone()
    for row, first_trained in enumerate([0, 15, 8, 14]):
        labels[row, :first_trained] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels}


def gradient(model) -> torch.Tensor:
    return torch.cat([parameter.grad.flatten() for parameter in model.parameters() if parameter.grad is not None])


def test_trained_tokens_are_counted_after_the_shift():
    labels = torch.tensor([[5, 6, IGNORE_INDEX, 7], [8, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]])
    assert trained_token_count(labels).item() == 2  # the first label of a row predicts nothing
    assert trained_token_count(uneven_rows(50)["labels"]).item() == 15 + 1 + 8 + 2


@pytest.mark.parametrize(("ranks", "accumulation_steps"), [(1, 4), (2, 2), (4, 1)])
def test_any_split_of_a_global_batch_gives_its_token_mean_loss_and_gradient(model, ranks, accumulation_steps):
    rows = uneven_rows(model.config.vocab_size)
    whole = model(**rows).loss  # transformers' mean over the batch's trained tokens
    whole.backward()
    whole_gradient = gradient(model)
    model.zero_grad()

    # One row per micro-batch; rank r takes rows r*GAS .. r*GAS+GAS-1.
    micro_batches = [{name: tensor[row:row + 1] for name, tensor in rows.items()} for row in range(4)]
    tokens = step_token_count(micro_batches, world_size=1, device="cpu")  # every rank's batches: the all-reduce
    step_loss, rank_gradients = 0.0, []
    for rank in range(ranks):
        for batch in micro_batches[rank * accumulation_steps:(rank + 1) * accumulation_steps]:
            loss = model(**batch, num_items_in_batch=tokens).loss
            loss_to_backpropagate(loss, ranks).backward()  # DeepSpeed's backward(scale_wrt_gas=False)
            step_loss += loss.item()
        rank_gradients.append(gradient(model))
        model.zero_grad()
    averaged = torch.stack(rank_gradients).mean(dim=0)  # DeepSpeed's gradient reduction over ranks

    assert step_loss == pytest.approx(whole.item(), rel=1e-6)
    torch.testing.assert_close(averaged, whole_gradient, rtol=1e-5, atol=1e-7)


def test_a_step_that_trains_no_token_has_zero_loss_and_gradient(model):
    rows = uneven_rows(model.config.vocab_size)
    rows["labels"][:] = IGNORE_INDEX
    tokens = step_token_count([rows], world_size=1, device="cpu")
    loss = model(**rows, num_items_in_batch=tokens).loss
    loss_to_backpropagate(loss, 1).backward()
    assert loss.item() == 0.0
    assert not gradient(model).any()


def test_models_whose_loss_drops_the_token_count_are_refused(model):
    from peft import LoraConfig, get_peft_model

    check_loss_takes_token_count(model)
    check_loss_takes_token_count(get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear")))

    class MeanLossOnly(LlamaForCausalLM):  # as transformers marks some multimodal models
        accepts_loss_kwargs = False

    with pytest.raises(ConfigError, match="base model class MeanLossOnly does not take num_items_in_batch"):
        check_loss_takes_token_count(MeanLossOnly(model.config))
