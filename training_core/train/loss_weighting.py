"""One optimizer step's objective: the mean loss over every trained token of its global batch.

A step's global batch is its gradient-accumulation micro-batches on every rank. Averaging each
micro-batch's own token mean (what a causal LM's `.loss` is) would weight a token by how few trained
tokens share its micro-batch, so the objective and the loss curve would change with how the same rows
are split across micro_batch_size, gradient_accumulation_steps and num_workers. Instead every
micro-batch's loss is its summed token loss divided by the step's token count, which transformers'
causal-LM loss computes when given that count as `num_items_in_batch`.
"""

from __future__ import annotations

import inspect

import torch

from training_core.data.packing import IGNORE_INDEX
from training_core.errors import ConfigError


def trained_token_count(labels: torch.Tensor) -> torch.Tensor:
    """Tokens a causal LM's loss counts in ``labels``, as transformers' ForCausalLMLoss does after
    its shift by one: every label but each row's first (no position predicts it), less the ignored."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def step_token_count(micro_batches: list[dict[str, torch.Tensor | int]], world_size: int,
                     device: torch.device | str) -> torch.Tensor:
    """Trained tokens in one optimizer step's global batch: these micro-batches, on every rank.

    One all-reduce of a scalar per step, a rendezvous of all ranks (about a millisecond with gloo
    on CPU). Every rank calls it once per step, as ranks take the same number of micro-batches."""
    count = sum(trained_token_count(batch["labels"]) for batch in micro_batches).to(device)
    if world_size > 1:
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.SUM)
    # A global batch of prompt tokens only has no loss: its summed loss 0 over 1 gives a zero
    # gradient, where 0 over 0 would give NaN weights.
    return count.clamp(min=1)


def loss_to_backpropagate(micro_batch_loss: torch.Tensor, world_size: int) -> torch.Tensor:
    """What to hand DeepSpeed's `backward(..., scale_wrt_gas=False)` for one micro-batch whose loss is
    its summed token loss over the step's token count: DeepSpeed averages gradients over ranks
    (divides by world_size), and the step's gradient must be the sum of every rank's."""
    return micro_batch_loss * world_size


def check_loss_takes_token_count(model: torch.nn.Module) -> None:
    """Refuse a model whose forward drops `num_items_in_batch`: its loss would stay a per-micro-batch
    mean and be weighted wrongly without any error. transformers marks such models (some multimodal
    ones) with `accepts_loss_kwargs = False`; a forward without ``**kwargs`` cannot take it either."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model passes it on
    takes_kwargs = any(parameter.kind == inspect.Parameter.VAR_KEYWORD
                       for parameter in inspect.signature(base.forward).parameters.values())
    if not takes_kwargs or getattr(base, "accepts_loss_kwargs", True) is False:
        raise ConfigError(
            f"base model class {type(base).__name__} does not take num_items_in_batch in its loss: Tessera weights "
            f"each optimizer step's loss by the trained tokens of all its micro-batches and cannot train it"
        )
