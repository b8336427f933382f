"""Tokenize instruction records and pack them into fixed-length training rows.

Each row holds whole examples back to back (`<bos> prompt response <eos>`), padded at the end.
Labels are -100 on prompt and padding tokens, so the loss trains only the responses.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from training_core.errors import SourceDataError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenizedExample:
    prompt_ids: list[int]
    response_ids: list[int]  # ends with eos


def is_eval_example(prompt: str, eval_fraction: float) -> bool:
    """Split by a hash of the prompt: the same prompt always lands in the same split, so no prompt
    can leak from training into evaluation, whatever the partition or record order."""
    bucket = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "little") % 10_000
    return bucket < eval_fraction * 10_000


def tokenize_example(tokenizer, prompt: str, response: str) -> TokenizedExample:
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id, *prompt_ids]
    return TokenizedExample(prompt_ids=list(prompt_ids), response_ids=[*response_ids, tokenizer.eos_token_id])


def pack_examples(
    examples: list[TokenizedExample],
    seq_len: int,
    pad_token_id: int,
    describe: Callable[[int], str] = lambda index: f"example {index}",
) -> dict[str, np.ndarray]:
    """Greedy in-order packing; returns `input_ids` and `labels` as int32 arrays [rows, seq_len].
    `describe(index)` names an example in the error for one longer than `seq_len`."""
    rows_ids: list[list[int]] = []
    rows_labels: list[list[int]] = []
    current_ids: list[int] = []
    current_labels: list[int] = []

    def close_row() -> None:
        padding = seq_len - len(current_ids)
        rows_ids.append(current_ids + [pad_token_id] * padding)
        rows_labels.append(current_labels + [IGNORE_INDEX] * padding)

    for index, example in enumerate(examples):
        ids = example.prompt_ids + example.response_ids
        if len(ids) > seq_len:
            raise SourceDataError(
                f"{describe(index)}: {len(ids)} tokens do not fit seq_len={seq_len}; raise seq_len or shorten the record"
            )
        if len(current_ids) + len(ids) > seq_len:
            close_row()
            current_ids, current_labels = [], []
        current_ids.extend(ids)
        current_labels.extend([IGNORE_INDEX] * len(example.prompt_ids) + example.response_ids)
    if current_ids:
        close_row()
    return {
        "input_ids": np.asarray(rows_ids, dtype=np.int32).reshape(-1, seq_len),
        "labels": np.asarray(rows_labels, dtype=np.int32).reshape(-1, seq_len),
    }
