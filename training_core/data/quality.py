"""Data-quality checks on a published training dataset (pure functions over its files)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from training_core.data.dataset_writer import read_eval_records
from training_core.data.packing import IGNORE_INDEX, tokenize_example


# What run_dataset_checks returns, in order; the Dagster asset declares its check specs from it.
DATASET_CHECK_NAMES = ("schema", "no_empty_rows", "no_duplicate_rows", "token_lengths", "no_eval_leakage")


@dataclass(frozen=True)
class CheckOutcome:
    name: str
    passed: bool
    description: str
    metadata: dict = field(default_factory=dict)


def _train_arrays(dataset_path: str) -> tuple[pa.Schema, np.ndarray, np.ndarray]:
    table = pq.read_table(Path(dataset_path) / "train")
    width = len(table.column("input_ids")[0]) if table.num_rows else 0
    as_2d = lambda name: np.asarray(table.column(name).combine_chunks().flatten()).reshape(-1, width)  # noqa: E731
    return table.schema, as_2d("input_ids"), as_2d("labels")


def check_schema(schema: pa.Schema, seq_len: int, widths: set[int]) -> CheckOutcome:
    expected = {"input_ids": pa.list_(pa.int32()), "labels": pa.list_(pa.int32())}
    actual = {name: schema.field(name).type for name in schema.names}
    problems = [f"{n}: expected {t}, got {actual.get(n)}" for n, t in expected.items() if actual.get(n) != t]
    if widths != {seq_len}:
        problems.append(f"row widths {sorted(widths)} != seq_len {seq_len}")
    return CheckOutcome("schema", not problems, "; ".join(problems) or "input_ids, labels: list<int32>[seq_len]",
                        {"columns": ",".join(schema.names)})


def check_rows(input_ids: np.ndarray, labels: np.ndarray, pad_token_id: int) -> list[CheckOutcome]:
    trained_tokens = (labels != IGNORE_INDEX).sum(axis=1)
    empty = int((trained_tokens == 0).sum())
    row_hashes = {hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in input_ids}
    duplicates = len(input_ids) - len(row_hashes)
    lengths = (input_ids != pad_token_id).sum(axis=1) if len(input_ids) else np.zeros(1)
    percentiles = {f"tokens_p{p}": float(np.percentile(lengths, p)) for p in (5, 50, 95)}
    fill = float(lengths.mean() / input_ids.shape[1]) if len(input_ids) else 0.0
    return [
        CheckOutcome("no_empty_rows", empty == 0 and len(input_ids) > 0,
                     f"{empty} of {len(input_ids)} rows train no token", {"empty_rows": empty, "rows": len(input_ids)}),
        # Packed rows of distinct examples never repeat; a repeat means duplicated source records.
        CheckOutcome("no_duplicate_rows", duplicates == 0, f"{duplicates} duplicate packed rows",
                     {"duplicate_rows": duplicates}),
        CheckOutcome("token_lengths", fill >= 0.5, f"mean row fill {fill:.0%} (packing must fill ≥ 50%)",
                     {**percentiles, "mean_fill": fill}),
    ]


def check_no_eval_leakage(input_ids: np.ndarray, dataset_path: str, tokenizer) -> CheckOutcome:
    """No held-out example (prompt + response tokens) occurs in any packed training row."""
    eval_sequences = set()
    for record in read_eval_records(dataset_path):
        example = tokenize_example(tokenizer, record["prompt"], record["response"])
        eval_sequences.add(tuple(example.prompt_ids + example.response_ids))
    # Every example starts with <bos> when the tokenizer has one, so only windows there can match.
    leaked = count_occurrences(input_ids, eval_sequences, start_token=tokenizer.bos_token_id)
    return CheckOutcome("no_eval_leakage", leaked == 0,
                        f"{leaked} held-out examples found in training rows ({len(eval_sequences)} held out)",
                        {"leaked_examples": leaked, "eval_examples": len(eval_sequences)})


_HASH_BASE = np.uint64(1_000_003)
_ROWS_PER_CHUNK = 4096  # bounds memory: a chunk's hashes are rows × width × 8 bytes


def count_occurrences(rows: np.ndarray, sequences: set[tuple[int, ...]], start_token: int | None = None,
                      rows_per_chunk: int = _ROWS_PER_CHUNK) -> int:
    """How many times any of ``sequences`` occurs contiguously in a row of ``rows`` ([n, width]).

    Polynomial hashes (mod 2**64) of the windows of each sequence length, computed with NumPy from
    per-row prefix hashes; windows whose hash matches are compared token by token, so a collision
    never counts. With ``start_token`` only windows starting at that token are looked at (every
    sequence starts with it, else all windows are; either way the count is the same). For 20 000
    rows × 512 tokens and 200 held-out examples of 40 lengths: 0.6 s, where scanning every window
    in Python took ~125 s (3.9 s here without a start token)."""
    width = rows.shape[1] if rows.ndim == 2 else 0
    sequences = {s for s in sequences if 0 < len(s) <= width}
    if rows.size == 0 or not sequences:
        return 0
    if start_token is not None and any(s[0] != start_token for s in sequences):
        start_token = None
    by_length: dict[int, dict[int, list[tuple[int, ...]]]] = {}
    for sequence in sequences:
        value = 0
        for token in sequence:
            value = (value * int(_HASH_BASE) + token + 1) % 2**64
        by_length.setdefault(len(sequence), {}).setdefault(value, []).append(sequence)
    return sum(_count_in_chunk(rows[lo : lo + rows_per_chunk], by_length, start_token)
               for lo in range(0, len(rows), rows_per_chunk))


def _count_in_chunk(rows: np.ndarray, by_length: dict, start_token: int | None) -> int:
    n, width = rows.shape
    prefix = np.zeros((n, width + 1), dtype=np.uint64)
    tokens = rows.astype(np.uint64) + np.uint64(1)  # +1: a run of 0 tokens must not hash like nothing
    with np.errstate(over="ignore"):
        for j in range(width):
            prefix[:, j + 1] = prefix[:, j] * _HASH_BASE + tokens[:, j]
    if start_token is not None:
        token_rows, token_starts = np.nonzero(rows == start_token)
    found = 0
    for length, wanted in by_length.items():
        power = np.uint64(pow(int(_HASH_BASE), length, 2**64))
        targets = np.fromiter(wanted, dtype=np.uint64, count=len(wanted))
        with np.errstate(over="ignore"):
            if start_token is None:  # every window, as [n, starts] slices
                hashes = prefix[:, length:] - prefix[:, : width - length + 1] * power
                row_of, start_of = np.nonzero(np.isin(hashes, targets))
                hashes = hashes[row_of, start_of]
            else:
                fits = token_starts <= width - length
                row_of, start_of = token_rows[fits], token_starts[fits]
                hashes = prefix[row_of, start_of + length] - prefix[row_of, start_of] * power
                hit = np.isin(hashes, targets)
                row_of, start_of, hashes = row_of[hit], start_of[hit], hashes[hit]
        for row, start, value in zip(row_of.tolist(), start_of.tolist(), hashes.tolist()):
            found += tuple(rows[row, start : start + length].tolist()) in wanted[value]
    return found


def run_dataset_checks(dataset_path: str, seq_len: int, tokenizer) -> list[CheckOutcome]:
    schema, input_ids, labels = _train_arrays(dataset_path)
    widths = {input_ids.shape[1]} if input_ids.size else set()
    outcomes = [
        check_schema(schema, seq_len, widths or {seq_len}),
        *check_rows(input_ids, labels, tokenizer.pad_token_id),
        check_no_eval_leakage(input_ids, dataset_path, tokenizer),
    ]
    assert tuple(o.name for o in outcomes) == DATASET_CHECK_NAMES, "update DATASET_CHECK_NAMES with the checks"
    return outcomes
