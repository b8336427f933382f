"""Reading instruction records (`prompt`, `response`) from JSONL, CSV or Parquet files.

Every malformed record raises `SourceDataError` naming the file and line (JSONL/CSV: 1-based line
number; Parquet: 0-based row index), so the fix is one edit away.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

from training_core.errors import SourceDataError

REQUIRED_FIELDS = ("prompt", "response")
SUPPORTED_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def list_source_files(source: str | Path) -> list[Path]:
    """The data files at `source` (a file or a directory searched recursively), sorted."""
    path = Path(source)
    if not path.exists():
        raise SourceDataError(f"source path {path} does not exist")
    if path.is_file():
        files = [path]
    else:
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and p.suffix in SUPPORTED_SUFFIXES and not p.name.startswith((".", "_"))
        )
    if not files:
        raise SourceDataError(f"no {'/'.join(SUPPORTED_SUFFIXES)} files under {path}")
    return files


def _validated(record: object, where: str) -> dict[str, str]:
    if not isinstance(record, dict):
        raise SourceDataError(f"{where}: expected an object with {REQUIRED_FIELDS}, got {type(record).__name__}")
    clean = {}
    for field in REQUIRED_FIELDS:
        if field not in record or record[field] is None:
            raise SourceDataError(f"{where}: missing field '{field}'")
        value = record[field]
        if not isinstance(value, str) or not value.strip():
            raise SourceDataError(f"{where}: field '{field}' must be a non-empty string, got {value!r}")
        clean[field] = value
    return clean


def _read_jsonl(path: Path) -> Iterator[dict[str, str]]:
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise SourceDataError(f"line {line_number} of {path}: not valid JSON ({error.msg})") from error
            yield _validated(record, f"line {line_number} of {path}")


def _read_csv(path: Path) -> Iterator[dict[str, str]]:
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [f for f in REQUIRED_FIELDS if f not in (reader.fieldnames or [])]
        if missing:
            raise SourceDataError(f"{path}: header lacks column(s) {missing}")
        for line_number, row in enumerate(reader, start=2):
            yield _validated(row, f"line {line_number} of {path}")


def _read_parquet(path: Path) -> Iterator[dict[str, str]]:
    try:
        table = pq.read_table(path)
    except Exception as error:  # pyarrow raises several types for unreadable files
        raise SourceDataError(f"{path}: not a readable Parquet file ({error})") from error
    missing = [f for f in REQUIRED_FIELDS if f not in table.column_names]
    if missing:
        raise SourceDataError(f"{path}: schema lacks column(s) {missing}")
    for row_index, row in enumerate(table.select(list(REQUIRED_FIELDS)).to_pylist()):
        yield _validated(row, f"row {row_index} of {path}")


def read_records(source: str | Path) -> list[dict[str, str]]:
    """All records from every data file at `source`, in file order."""
    records: list[dict[str, str]] = []
    for path in list_source_files(source):
        try:
            if path.suffix in (".jsonl", ".json"):
                records.extend(_read_jsonl(path))
            elif path.suffix == ".csv":
                records.extend(_read_csv(path))
            else:
                records.extend(_read_parquet(path))
        except (OSError, UnicodeDecodeError) as error:
            raise SourceDataError(f"{path}: cannot be read ({error})") from error
    return records
