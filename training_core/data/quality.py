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
    lengths = {len(s) for s in eval_sequences}
    leaked = 0
    for row in input_ids.tolist():
        for length in lengths:
            leaked += sum(tuple(row[i : i + length]) in eval_sequences for i in range(len(row) - length + 1))
    return CheckOutcome("no_eval_leakage", leaked == 0,
                        f"{leaked} held-out examples found in training rows ({len(eval_sequences)} held out)",
                        {"leaked_examples": leaked, "eval_examples": len(eval_sequences)})


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
