"""Tessera's FLOPs-per-token estimate against torch's own count of one forward and backward pass."""
from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from training_core.train.model_setup import attention_shape, count_matmul_weights
from training_core.train.telemetry import model_flops_per_token


def estimated_over_measured_flops(model: torch.nn.Module, seq_len: int = 64, batch: int = 2) -> float:
    """The estimate MFU is built on, divided by what torch counts for a training step on random tokens."""
    estimate = model_flops_per_token(*count_matmul_weights(model), *attention_shape(model.config), seq_len)
    ids = torch.randint(0, 500, (batch, seq_len))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return estimate / (counter.get_total_flops() / (batch * seq_len))
