"""Data-quality checks on a published training dataset (pure functions over its files)."""

from __future__ import annotations

import array
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from training_core.data.dataset_writer import batched, read_eval_records, read_prompt_format
from training_core.data.frozen_records import read_frozen_record
from training_core.data.packing import IGNORE_INDEX, content_lengths, example_starts, tokenize_examples
from training_core.data.prompt_format import PLAIN
from training_core.data.sources import RecordLocations


# What run_dataset_checks returns, in order; the Dagster asset declares its check specs from it.
DATASET_CHECK_NAMES = ("schema", "no_empty_rows", "no_duplicate_rows", "token_lengths", "no_eval_leakage")


@dataclass(frozen=True)
class CheckOutcome:
    name: str
    passed: bool
    description: str
    metadata: dict = field(default_factory=dict)


def check_schema(schema: pa.Schema, seq_len: int, widths: set[int]) -> CheckOutcome:
    expected = {"input_ids": pa.list_(pa.int32()), "labels": pa.list_(pa.int32())}
    actual = {name: schema.field(name).type for name in schema.names}
    problems = [f"{n}: expected {t}, got {actual.get(n)}" for n, t in expected.items() if actual.get(n) != t]
    if widths != {seq_len}:
        problems.append(f"row widths {sorted(widths)} != seq_len {seq_len}")
    return CheckOutcome("schema", not problems, "; ".join(problems) or "input_ids, labels: list<int32>[seq_len]",
                        {"columns": ",".join(schema.names)})


class _RowStats:
    """What the row checks need, gathered row group by row group: memory grows with one hash and
    one length per row, never with the tokens (a day's dataset may not fit in memory)."""

    def __init__(self) -> None:
        self.rows, self.empty = 0, 0
        self.hashes: set[bytes] = set()
        self.lengths: list[np.ndarray] = []

    def add(self, input_ids: np.ndarray, labels: np.ndarray) -> None:
        self.rows += len(input_ids)
        self.empty += int(((labels != IGNORE_INDEX).sum(axis=1) == 0).sum())
        self.hashes.update(hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in input_ids)
        self.lengths.append(content_lengths(labels).astype(np.int32))

    @property
    def duplicate_rows(self) -> int:
        return self.rows - len(self.hashes)

    def outcomes(self, width: int) -> list[CheckOutcome]:
        return [
            CheckOutcome("no_empty_rows", self.empty == 0 and self.rows > 0,
                         f"{self.empty} of {self.rows} rows train no token", {"empty_rows": self.empty, "rows": self.rows}),
            self._fill_outcome(width),
        ]

    def _fill_outcome(self, width: int) -> CheckOutcome:
        """Packing closes a row only when the next example does not fit, so every row but the last is
        as full as in-order packing gets; the last holds what was left over, however little, and is
        left out of the judged fill (a small day at a large seq_len is one partly filled row)."""
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int32)
        percentiles = {f"tokens_p{p}": float(np.percentile(lengths, p)) if len(lengths) else 0.0 for p in (5, 50, 95)}
        fill = float(lengths.mean() / width) if len(lengths) and width else 0.0
        metadata = {**percentiles, "mean_fill": fill}
        if len(lengths) == 1:
            return CheckOutcome("token_lengths", True, f"one row, {fill:.0%} filled: the whole day fits in it, so no "
                                "packing could fill it more", metadata)
        packed_fill = float(lengths[:-1].mean() / width) if len(lengths) and width else 0.0
        metadata["fill_before_last_row"] = packed_fill
        return CheckOutcome("token_lengths", packed_fill >= 0.5,
                            f"mean row fill {packed_fill:.0%} before the last row, which holds what was left over "
                            f"(packing must fill ≥ 50%; {fill:.0%} with it)", metadata)


def _eval_sequences(dataset_path: str, tokenizer, prompt_format: str) -> dict[tuple[int, ...], dict[str, str]]:
    """The held-out examples' token sequences, tokenized as the writer tokenized the training rows,
    each with (the first of) the held-out records it is."""
    records = read_eval_records(dataset_path)
    examples = tokenize_examples(tokenizer, [r["prompt"] for r in records], [r["response"] for r in records],
                                 prompt_format)
    sequences: dict[tuple[int, ...], dict[str, str]] = {}
    for record, example in zip(records, examples):
        sequences.setdefault(tuple(example.prompt_ids + example.response_ids), record)
    return sequences


def _token_key(token_ids: list[int] | tuple[int, ...]) -> bytes:
    return hashlib.blake2b(array.array("i", token_ids).tobytes(), digest_size=16).digest()


def _text_key(record: dict[str, str]) -> tuple[str, str]:
    return record["prompt"], record["response"]


_TOKENIZE_BATCH = 1024


class SourceRecords:
    """The day's source records as the model sees them, tokenized again as the writer tokenized them
    (in batches, read as they come; memory grows with one key per distinct record): which repeat an
    earlier one, and where each held-out example's record is. Tokens, not text, are compared: records
    that differ in text may tokenize alike (the NFC and NFD forms of one prompt, for a tokenizer that
    normalizes Unicode), and the model then trains on them twice all the same.

    ``records`` is a list, or a one-pass iterator of the records in ``records_path`` (the frozen
    file): the earlier record a repeat names is then read again from there, for the few named."""

    def __init__(self, records: Iterable[dict[str, str]], tokenizer, records_path: str | None,
                 held_out: dict[tuple[int, ...], dict[str, str]], limit: int = 3,
                 prompt_format: str = PLAIN) -> None:
        if not isinstance(records, Sequence) and records_path is None:
            raise ValueError("SourceRecords: records read once (an iterator) need records_path, the file they are "
                             "read from, to name the earlier record a repeat repeats")
        self.records, self.records_path, self.locations = records, records_path, RecordLocations(records_path)
        self.count, self.repeated, self.repeat_examples = 0, 0, []
        held_out_texts = {_token_key(sequence): _text_key(record) for sequence, record in held_out.items()}
        self.held_out_at: dict[bytes, int] = {}  # where each held-out example's record is
        first: dict[bytes, int] = {}
        for batch in batched(records, _TOKENIZE_BATCH):
            start, self.count = self.count, self.count + len(batch)
            examples = tokenize_examples(tokenizer, [r["prompt"] for r in batch], [r["response"] for r in batch],
                                         prompt_format)
            for index, (record, example) in enumerate(zip(batch, examples), start=start):
                key = _token_key(example.prompt_ids + example.response_ids)
                if key in held_out_texts and _text_key(record) == held_out_texts[key]:
                    self.held_out_at.setdefault(key, index)
                earlier = first.setdefault(key, index)
                if earlier != index:
                    self.repeated += 1
                    if len(self.repeat_examples) < limit:
                        self.repeat_examples.append(self._describe_repeat(index, record, earlier))

    def where(self, index: int) -> str:
        """The record as the user finds it: in their own file when its origins were kept."""
        return self.locations.users(index) or self.locations.frozen(index)

    def _record(self, index: int) -> dict[str, str]:
        if isinstance(self.records, Sequence):
            return self.records[index]
        return read_frozen_record(self.records_path, index)

    def _describe_repeat(self, index: int, record: dict[str, str], earlier: int) -> str:
        alike = _text_key(record) == _text_key(self._record(earlier))
        return f"{self.where(index)} repeats {self.where(earlier)}" + ("" if alike else " (other text, same tokens)")


def _leakage_outcome(leaked: int, held_out: dict[tuple[int, ...], dict[str, str]],
                     found_at: dict[tuple[int, ...], tuple[str, int]], source: SourceRecords | None,
                     limit: int = 3) -> CheckOutcome:
    """No held-out example (prompt + response tokens) is packed, whole, as an example of a training
    row. A failure names the first ones found: the held-out record (its line in the user's file when
    the day's records are known, else its prompt) and the training row holding it."""
    description = f"{leaked} held-out examples found in training rows ({len(held_out)} held out)"
    named = []
    for sequence, (file_name, row) in list(found_at.items())[:limit]:
        key = _token_key(sequence)
        if source is not None and key in source.held_out_at:
            what = f"held-out {source.where(source.held_out_at[key])}"
        else:
            what = f"held-out prompt {held_out[sequence]['prompt'][:40]!r}"
        named.append(f"{what} is in row {row} of train/{file_name}")
    if named:
        description += ", e.g. " + "; ".join(named)
    return CheckOutcome("no_eval_leakage", leaked == 0, description,
                        {"leaked_examples": leaked, "eval_examples": len(held_out)})


_HASH_BASE = np.uint64(1_000_003)
_ROWS_PER_CHUNK = 4096  # bounds memory: a chunk's hashes are rows × width × 8 bytes


class SequenceIndex:
    """The sequences hashed once by length, for finding them in many row groups.

    Polynomial hashes (mod 2**64) of the windows of each sequence length, computed with NumPy from
    per-row prefix hashes; windows whose hash matches are compared token by token, so a collision
    never counts. With ``start_token`` only windows starting at that token are looked at (every
    sequence starts with it, else all windows are; either way the result is the same). For 20 000
    rows × 512 tokens and 200 held-out examples of 40 lengths: 0.6 s, where scanning every window
    in Python took ~125 s (3.9 s here without a start token)."""

    def __init__(self, sequences: set[tuple[int, ...]], start_token: int | None = None) -> None:
        self.sequences = {s for s in sequences if len(s) > 0}
        # start_token only narrows where to look, so it is dropped when a sequence starts otherwise
        self.start_token = start_token if all(s[0] == start_token for s in self.sequences) else None
        self.by_length: dict[int, dict[int, list[tuple[int, ...]]]] = {}
        for sequence in self.sequences:
            value = 0
            for token in sequence:
                value = (value * int(_HASH_BASE) + token + 1) % 2**64
            self.by_length.setdefault(len(sequence), {}).setdefault(value, []).append(sequence)

    def find(self, rows: np.ndarray, rows_per_chunk: int = _ROWS_PER_CHUNK,
             starts: np.ndarray | None = None) -> list[tuple[int, tuple[int, ...]]]:
        """Each occurrence in ``rows`` ([n, width]) of a window starting where ``starts`` (booleans
        shaped like ``rows``) is true, or anywhere without it, as (row index, the sequence), in row order."""
        width = rows.shape[1] if rows.ndim == 2 else 0
        by_length = {length: wanted for length, wanted in self.by_length.items() if length <= width}
        if rows.size == 0 or not by_length:
            return []
        found = []
        for lo in range(0, len(rows), rows_per_chunk):
            chunk_starts = None if starts is None else starts[lo : lo + rows_per_chunk]
            found += [(lo + row, sequence) for row, sequence in
                      _find_in_chunk(rows[lo : lo + rows_per_chunk], by_length, self.start_token, chunk_starts)]
        return sorted(found, key=lambda hit: hit[0])


def _find_in_chunk(rows: np.ndarray, by_length: dict, start_token: int | None,
                   starts: np.ndarray | None) -> list[tuple[int, tuple[int, ...]]]:
    n, width = rows.shape
    prefix = np.zeros((n, width + 1), dtype=np.uint64)
    tokens = rows.astype(np.uint64) + np.uint64(1)  # +1: a run of 0 tokens must not hash like nothing
    with np.errstate(over="ignore"):
        for j in range(width):
            prefix[:, j + 1] = prefix[:, j] * _HASH_BASE + tokens[:, j]
    anchored = start_token is not None or starts is not None
    if anchored:
        allowed = np.ones(rows.shape, dtype=bool) if starts is None else starts
        if start_token is not None:
            allowed = allowed & (rows == start_token)
        anchor_rows, anchor_starts = np.nonzero(allowed)
    found = []
    for length, wanted in by_length.items():
        power = np.uint64(pow(int(_HASH_BASE), length, 2**64))
        targets = np.fromiter(wanted, dtype=np.uint64, count=len(wanted))
        with np.errstate(over="ignore"):
            if not anchored:  # every window, as [n, starts] slices
                hashes = prefix[:, length:] - prefix[:, : width - length + 1] * power
                row_of, start_of = np.nonzero(np.isin(hashes, targets))
                hashes = hashes[row_of, start_of]
            else:
                fits = anchor_starts <= width - length
                row_of, start_of = anchor_rows[fits], anchor_starts[fits]
                hashes = prefix[row_of, start_of + length] - prefix[row_of, start_of] * power
                hit = np.isin(hashes, targets)
                row_of, start_of, hashes = row_of[hit], start_of[hit], hashes[hit]
        for row, start, value in zip(row_of.tolist(), start_of.tolist(), hashes.tolist()):
            window = tuple(rows[row, start : start + length].tolist())
            if window in wanted[value]:
                found.append((row, window))
    return found


def _row_widths(column: pa.ChunkedArray) -> np.ndarray:
    array = column.combine_chunks()
    return np.diff(np.asarray(array.offsets)) if len(array) else np.zeros(0, np.int64)


def _as_rows(column: pa.ChunkedArray, width: int) -> np.ndarray:
    return np.asarray(column.combine_chunks().flatten()).reshape(-1, width)


def _as_frozen(records_path: str | None) -> str:
    """Which copy of the source the line numbers describe: later edits to the user's file are not in it."""
    if records_path is None:
        return ""
    frozen_at = datetime.fromtimestamp(Path(records_path).stat().st_mtime, timezone.utc)
    return (f" (lines of the source as raw_examples froze it at {frozen_at:%Y-%m-%d %H:%M} UTC; after fixing it, "
            "rematerialize raw_examples, then training_dataset)")


# Share of source records that may repeat an earlier one: real exports (and the demo's small task
# space: 0.5 % at 4 000 records, 2 % at 20 000) repeat some; a file exported twice repeats half.
MAX_REPEATED_RECORDS = 0.05


def _duplicate_outcome(duplicate_rows: int, source: SourceRecords | None, max_repeated_records: float) -> CheckOutcome:
    """Without the source records, any repeated packed row fails: rows of distinct examples never
    repeat. With them the records are judged: every example of a repeated row repeats an earlier
    example, so repeated rows that number no more than the repeated records are those repeats, packed
    alike, and pass while the repeats stay within ``max_repeated_records`` of the records."""
    rows = f"{duplicate_rows} duplicate packed rows"
    if source is None:
        return CheckOutcome("no_duplicate_rows", duplicate_rows == 0, rows, {"duplicate_rows": duplicate_rows})
    metadata = {"duplicate_rows": duplicate_rows, "duplicate_records": source.repeated}
    repeated, total = source.repeated, source.count
    if not repeated:
        return CheckOutcome("no_duplicate_rows", duplicate_rows == 0,
                            f"{rows}; no source record repeats an earlier one's tokens"
                            + (", so these rows are not packed from these records" if duplicate_rows else ""), metadata)
    too_many = repeated > max_repeated_records * total
    unexplained = duplicate_rows > repeated
    allowed = f"{max_repeated_records * 100:g}%"
    share = f"{repeated / total:.1%}, {'more than' if too_many else 'within'} the {allowed} allowed"
    description = (rows + (", more than the repeated records explain" if unexplained else "")
                   + f": {repeated} source records ({share}) repeat an earlier one, e.g. "
                   + "; ".join(source.repeat_examples))
    passed = not too_many and not unexplained
    if not passed:
        description += _as_frozen(source.records_path)
    return CheckOutcome("no_duplicate_rows", passed, description, metadata)


def run_dataset_checks(dataset_path: str, seq_len: int, tokenizer, records: Iterable[dict[str, str]] | None = None,
                       records_path: str | None = None,
                       max_repeated_records: float = MAX_REPEATED_RECORDS) -> list[CheckOutcome]:
    """Every check, reading the training split one row group at a time (bounded memory). With the
    source ``records`` (and ``records_path``, the frozen file they came from), tokenized again here,
    no_duplicate_rows judges the records: it fails when more than ``max_repeated_records`` of them
    repeat an earlier one as tokens (packing may put repeats into distinct rows), and passes repeated
    rows those repeats explain; the duplicate and leakage checks name the records in the user's files.
    ``records`` may be a one-pass iterator over the ``records_path`` file: it is read once, in batches."""
    files = sorted((Path(dataset_path) / "train").glob("*.parquet"))
    schema = pq.read_schema(files[0]) if files else pa.schema([])
    stats, widths, leaked = _RowStats(), set(), 0
    prompt_format = read_prompt_format(dataset_path)  # tokenized again as the writer tokenized them
    held_out = _eval_sequences(dataset_path, tokenizer, prompt_format)
    found_at: dict[tuple[int, ...], tuple[str, int]] = {}  # where each leaked example is first found
    # Only windows at an example's start count: a held-out example that is the tail of a longer
    # training one was not copied into training. Starts are read from the packed layout, so the
    # verdict is the same with a BOS or without one (Qwen has none); a BOS only narrows the look.
    held_out_index = SequenceIndex(held_out, start_token=tokenizer.bos_token_id)
    other_schema = [path.name for path in files[1:] if pq.read_schema(path) != schema]
    readable = {"input_ids", "labels"} <= set(schema.names)
    for path in files if readable and not other_schema else []:
        parquet = pq.ParquetFile(path)
        first_rows = np.cumsum([0] + [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)])
        for index in range(parquet.num_row_groups):
            table = parquet.read_row_group(index, columns=["input_ids", "labels"])
            row_widths = {int(w) for name in ("input_ids", "labels") for w in _row_widths(table.column(name))}
            widths |= row_widths
            if len(row_widths) != 1:  # ragged, or labels unlike input_ids: the schema check names the widths
                continue
            width = row_widths.pop()
            input_ids, labels = _as_rows(table.column("input_ids"), width), _as_rows(table.column("labels"), width)
            stats.add(input_ids, labels)
            hits = held_out_index.find(input_ids, starts=example_starts(input_ids, labels, tokenizer.eos_token_id))
            leaked += len(hits)
            for row, sequence in hits:
                found_at.setdefault(sequence, (path.name, int(first_rows[index]) + row))
    schema_outcome = check_schema(schema, seq_len, widths or {seq_len})
    if other_schema:
        schema_outcome = CheckOutcome("schema", False, f"{', '.join(other_schema)}: another schema than "
                                      f"{files[0].name} ({schema_outcome.description})", schema_outcome.metadata)
    source = (SourceRecords(records, tokenizer, records_path, held_out, prompt_format=prompt_format)
              if records is not None else None)
    if source is not None and not source.count:
        source = None  # no records to judge: as if none were given
    empty_rows, token_lengths = stats.outcomes(seq_len)
    outcomes = [
        schema_outcome,
        empty_rows,
        _duplicate_outcome(stats.duplicate_rows, source, max_repeated_records),
        token_lengths,
        _leakage_outcome(leaked, held_out, found_at, source),
    ]
    assert tuple(o.name for o in outcomes) == DATASET_CHECK_NAMES, "update DATASET_CHECK_NAMES with the checks"
    return outcomes
