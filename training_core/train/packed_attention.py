"""Per-example attention for packed training rows.

A packed row holds several examples back to back (training_core.data.packing); evaluation scores each
example alone. So that training sees each one as evaluation does, every example attends only to its
own tokens, its position ids restart at 0, and its first token is not a label (predicting it would
read the example before). Padding after a row's last example stays in that example's block: its
labels are IGNORE_INDEX, nothing before it attends to it, and it attends to itself, so no query is
left with nothing to attend to (sdpa returns NaN for such a row).

How the blocks reach the model depends on `TrainingConfig.attention`:
- sdpa and eager: a 4-D mask [batch, 1, seq, seq], block-diagonal and causal, in the additive form: 0
  where a query may attend, the dtype's lowest value elsewhere, in the model's dtype. transformers
  (masking_utils._preprocess_mask_arguments) passes a 4-D mask to attention as given, building no causal
  mask of its own. Not booleans for sdpa: torch's scaled_dot_product_attention turns a boolean mask into
  an additive one on every call, so each layer would keep its own converted copy for backward (4 GiB at
  8 rows of 4096 tokens on 16 layers in bf16); an additive mask is the one tensor every layer shares;
- flash_attention_2: no mask; the blocks as flash-attn's varlen arguments over the batch flattened
  (cu_seq_lens_q/k, max_length_q/k, as transformers' DataCollatorWithFlattening gives them).
  transformers reads blocks from position ids alone only for a batch of one row. Not run on CPU.

A model with sliding-window attention (Mistral, Phi-3, Gemma 2/3, gpt-oss, Cohere2, Qwen2 with
use_sliding_window) builds its window into the mask it makes itself; given a 4-D mask it takes it as the
whole truth, so the mask must hold the window too (else training attends further back than evaluation and
inference). A model whose config lists ``layer_types`` of both kinds takes a mask per layer type, as a dict;
one with sliding layers only takes a single mask (Mistral refuses a dict). The dict holds two masks:
twice the memory below.

A mask holds batch × seq × seq entries: at seq_len 4096, 32 MiB a row in bf16, 64 MiB in fp32. So a
step holds its micro-batches as packed_rows (tokens and position ids) and builds each one's
attention_inputs only as it goes to the model, on the model's device: built on the host, 8 rows of 4096
tokens took ~200 ms on two cores and a 256 MiB copy, while an accelerator waits (DeepSpeed syncs at
every optimizer step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from training_core.data.packing import IGNORE_INDEX, example_starts, row_eos_tokens


def packed_rows(input_ids: np.ndarray, labels: np.ndarray) -> dict[str, torch.Tensor]:
    """input_ids, labels and position_ids (restarting at 0 at each example) of packed rows: cheap,
    what a step holds for all its micro-batches; the attention inputs follow from the position ids."""
    starts = example_starts(input_ids, labels, row_eos_tokens(input_ids, labels))
    block_labels = labels.astype(np.int64)
    # an example's first token is not predicted from the one before (a row's first is never predicted)
    block_labels[:, 1:][starts[:, 1:]] = IGNORE_INDEX
    return {
        "input_ids": torch.from_numpy(input_ids.astype(np.int64)),
        "labels": torch.from_numpy(block_labels),
        "position_ids": torch.from_numpy(np.arange(starts.shape[1]) - _example_first_index(starts)),
    }


@dataclass(frozen=True)
class SlidingWindow:
    """A model's local attention: a query sees its own and the ``size - 1`` keys before it (transformers'
    sliding_window_overlay: key > query - size). ``per_layer_type``: its layers mix full and sliding
    attention, and it takes a mask per layer type."""

    size: int
    per_layer_type: bool


Mask = torch.Tensor | dict[str, torch.Tensor]


def attention_inputs(position_ids: torch.Tensor, attention: str, dtype: torch.dtype,
                     window: SlidingWindow | None = None, device: torch.device | str = "cpu") -> dict[str, Mask | int]:
    """What keeps the examples of packed rows apart for ``attention``, from their position ids (on the
    host, as packed_rows gives them), on ``device``: a mask of batch × seq × seq entries, built there
    only as a micro-batch goes to the model; cut to ``window`` for a model with sliding-window layers."""
    if attention == "flash_attention_2":
        # No window here: transformers' flash path gives each sliding layer flash-attn's window_size
        # (config.sliding_window - 1 keys back, causal) on the varlen path too
        # (modeling_flash_attention_utils._process_flash_attention_kwargs), and full layers none.
        return {name: value.to(device) if isinstance(value, torch.Tensor) else value
                for name, value in _flash_varlen_arguments((position_ids == 0).numpy()).items()}
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attention={attention!r}: packed rows need one of sdpa, eager, flash_attention_2")
    allowed = _block_causal_mask(position_ids.to(device, torch.int32))

    def additive(mask: torch.Tensor) -> torch.Tensor:
        return torch.full(mask.shape, torch.finfo(dtype).min, dtype=dtype, device=device).masked_fill_(mask, 0.0)

    if window is None:
        return {"attention_mask": additive(allowed)}
    windowed = additive(allowed & _within_window(allowed.shape[-1], window.size, device))
    if window.per_layer_type:
        return {"attention_mask": {"full_attention": additive(allowed), "sliding_attention": windowed}}
    return {"attention_mask": windowed}


def _example_first_index(starts: np.ndarray) -> np.ndarray:
    """Where each token's example starts in its row."""
    index = np.broadcast_to(np.arange(starts.shape[1]), starts.shape)
    return np.maximum.accumulate(np.where(starts, index, 0), axis=1)


def _block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq] booleans on position_ids' device: query q may attend to key k from its
    example's start (q - position of q) up to q. int32 and in place: on two CPU cores half what int64 took."""
    index = torch.arange(position_ids.shape[1], dtype=torch.int32, device=position_ids.device)
    allowed = index[None, None, :] >= (index - position_ids)[:, :, None]
    allowed &= index[None, :] <= index[:, None]
    return allowed[:, None]


def _within_window(width: int, size: int, device: torch.device | str) -> torch.Tensor:
    """[seq, seq] booleans: key k is among the ``size`` latest for query q (k > q - size)."""
    index = torch.arange(width, dtype=torch.int32, device=device)
    return index[None, :] > index[:, None] - size


def _flash_varlen_arguments(starts: np.ndarray) -> dict[str, torch.Tensor | int]:
    """Example boundaries over the batch flattened into one sequence, as flash-attn's varlen kernels
    take them: int32 cumulative lengths from 0 to batch × seq, and the longest example as an int."""
    boundaries = np.append(np.flatnonzero(starts), starts.size).astype(np.int32)
    longest = int(np.diff(boundaries).max())
    cumulative = torch.from_numpy(boundaries)
    return {"cu_seq_lens_q": cumulative, "cu_seq_lens_k": cumulative, "max_length_q": longest, "max_length_k": longest}
