"""Reading instruction records (`prompt`, `response`) from JSONL, CSV or Parquet files.

Every malformed record raises `SourceDataError` naming the file and line (JSONL/CSV: 1-based line
number, where the row starts; a `.json` array: 0-based item; Parquet: 0-based row index), so the
fix is one edit away. Text files must be UTF-8 (a byte-order mark is allowed).
"""

from __future__ import annotations

import csv
import io
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from training_core.errors import SourceDataError

REQUIRED_FIELDS = ("prompt", "response")
ORIGINS_FILE = ".origins.json"  # beside a frozen copy of records: hidden, outside its digest
SUPPORTED_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def list_source_files(source: str | Path) -> list[Path]:
    """The data files at `source` (a file or a directory searched recursively), sorted. Suffixes
    match in any case (`A.JSONL`); a file given directly must have one of them."""
    if not str(source).strip():
        raise SourceDataError("source is empty; give a JSONL/CSV/Parquet file or a folder of them")
    path = Path(source).expanduser()
    if not path.exists():
        raise SourceDataError(f"source path {path} does not exist")
    if path.is_file():
        if path.suffix.lower() not in SUPPORTED_SUFFIXES:
            raise SourceDataError(f"{path}: unsupported file type {path.suffix or '(no suffix)'!r}; "
                                  f"expected one of {'/'.join(SUPPORTED_SUFFIXES)}")
        files = [path]
    else:
        files = sorted(
            p
            for p in path.rglob("*")
            # Hidden and underscore names anywhere below `path` are not data: a writer's staging
            # folder (.staging-*, Spark's _temporary/) may hold partial files.
            if p.is_file() and p.suffix.lower() in SUPPORTED_SUFFIXES
            and not any(part.startswith((".", "_")) for part in p.relative_to(path).parts)
        )
    if not files:
        raise SourceDataError(f"no {'/'.join(SUPPORTED_SUFFIXES)} files under {path}")
    return files


def _read_text(path: Path) -> str:
    """The file as UTF-8 text (a leading byte-order mark, as Excel writes, is dropped); bytes that
    are not UTF-8 are refused with their line and column."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line_start = data.rfind(b"\n", 0, error.start) + 1
        line = data.count(b"\n", 0, error.start) + 1
        raise SourceDataError(
            f"line {line} of {path}: not UTF-8 (byte 0x{data[error.start]:02x} at column {error.start - line_start + 1}); "
            "save the file as UTF-8"
        ) from error


def _validated(record: object, where: str) -> dict[str, str]:
    if not isinstance(record, dict):
        raise SourceDataError(f"{where}: expected an object with {REQUIRED_FIELDS}, got {type(record).__name__}")
    clean = {}
    for field in REQUIRED_FIELDS:
        if field not in record:
            raise SourceDataError(f"{where}: missing field '{field}'")
        value = record[field]
        if value is None:  # told apart from a missing field: the fix is another edit
            raise SourceDataError(f"{where}: field '{field}' is null")
        if not isinstance(value, str) or not value.strip():
            raise SourceDataError(f"{where}: field '{field}' must be a non-empty string, got {value!r}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:  # e.g. a lone surrogate escape such as "\ud83d" in JSON
            raise SourceDataError(f"{where}: field '{field}' holds {value[error.start:error.end]!r}, "
                                  "which is not a valid Unicode character (half of a surrogate pair?)") from error
        clean[field] = value
    return clean


def _read_json(path: Path) -> tuple[str, Iterator[tuple[dict[str, str], int]]]:
    """("item", records of a `.json` array) or ("line", records of JSON Lines), the file read once."""
    text = _read_text(path)
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        return "item", _read_json_array(path, text)
    return "line", _read_json_lines(path, text)


def _read_json_lines(path: Path, text: str) -> Iterator[tuple[dict[str, str], int]]:
    for line_number, line in enumerate(text.split("\n"), start=1):  # not splitlines(): U+2028 may sit in a string
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            hint = " (.json files hold JSON Lines, one object per line, or one JSON array)" if path.suffix.lower() == ".json" else ""
            raise SourceDataError(f"line {line_number} of {path}: not valid JSON ({error.msg}){hint}") from error
        yield _validated(record, f"line {line_number} of {path}"), line_number


def _read_json_array(path: Path, text: str) -> Iterator[tuple[dict[str, str], int]]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as error:
        raise SourceDataError(f"line {error.lineno} of {path}: not valid JSON ({error.msg})") from error
    for index, item in enumerate(items):
        yield _validated(item, f"item {index} (0-based) of the JSON array in {path}"), index


def _read_csv(path: Path) -> Iterator[tuple[dict[str, str], int]]:
    text = _read_text(path)
    # csv's default limit (131,072 characters a field) would call a long but valid record malformed;
    # no field is longer than its file, and a record too long to train on is named where it is packed.
    csv.field_size_limit(max(csv.field_size_limit(), len(text)))
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(reader, [])
    except csv.Error as error:
        raise SourceDataError(f"line 1 of {path}: malformed CSV header ({error})") from error
    missing = [f for f in REQUIRED_FIELDS if f not in header]
    if missing:
        raise SourceDataError(f"{path}: header lacks column(s) {missing}; it has {header}")
    # A repeated name would keep only its last column's cells, silently.
    if repeated := sorted({name for name in header if header.count(name) > 1}):
        raise SourceDataError(f"line 1 of {path}: column(s) {repeated} appear more than once in the header {header}")
    while True:
        line_number = reader.line_num + 1  # where the next row starts (a quoted field may span lines)
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as error:  # e.g. a quote never closed
            raise SourceDataError(f"line {line_number} of {path}: malformed CSV ({error})") from error
        if not cells:
            continue  # blank line
        # zip would drop extra cells: a response cut at an unquoted comma. Empty ones (a trailing
        # comma a spreadsheet left) hold nothing to lose.
        if len(cells) > len(header) and any(cells[len(header):]):
            raise SourceDataError(f"line {line_number} of {path}: {len(cells)} cells but the header has {len(header)} "
                                  "columns (an unquoted comma? quote fields that contain commas)")
        yield _validated(dict(zip(header, cells)), f"line {line_number} of {path}"), line_number


def _read_parquet(path: Path) -> Iterator[tuple[dict[str, str], int]]:
    try:
        table = pq.read_table(path)
    except Exception as error:  # pyarrow raises several types for unreadable files
        raise SourceDataError(f"{path}: not a readable Parquet file ({error})") from error
    missing = [f for f in REQUIRED_FIELDS if f not in table.column_names]
    if missing:
        raise SourceDataError(f"{path}: schema lacks column(s) {missing}")
    for row_index, row in enumerate(table.select(list(REQUIRED_FIELDS)).to_pylist()):
        yield _validated(row, f"row {row_index} (0-based) of {path}"), row_index


@dataclass
class RecordOrigins:
    """Where each record came from: (file, line / array item / row). Kept beside a frozen copy of
    the records (hidden, outside its digest) so that a later error names the user's own file."""

    files: list[tuple[str, str]] = field(default_factory=list)  # (path, "line" | "item" | "row")
    positions: list[tuple[int, int]] = field(default_factory=list)  # (file index, number) per record

    def describe(self, index: int) -> str | None:
        if not 0 <= index < len(self.positions):
            return None
        file_index, number = self.positions[index]
        path, unit = self.files[file_index]
        return f"line {number} of {path}" if unit == "line" else f"{unit} {number} (0-based) of {path}"

    def save(self, path: Path) -> None:
        """Written whole (temporary file, then a rename): it may replace the origins beside a published
        copy that a concurrent reader is loading."""
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        temporary.write_text(json.dumps({"files": self.files, "positions": self.positions}))
        os.replace(temporary, path)

    @classmethod
    def load(cls, path: Path) -> "RecordOrigins | None":
        try:
            data = json.loads(path.read_text())
            return cls([tuple(f) for f in data["files"]], [tuple(p) for p in data["positions"]])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # no record of origins (demo data, or frozen before they were kept)


class RecordLocations:
    """Where record ``index`` of a frozen records file (JSON Lines) is, for messages: its line there,
    and its place in the user's own file when the origins were kept beside it."""

    def __init__(self, records_path: str | None) -> None:
        self.records_path = records_path
        self.origins = RecordOrigins.load(Path(records_path).parent / ORIGINS_FILE) if records_path else None

    def frozen(self, index: int) -> str:
        return f"line {index + 1} of {self.records_path}" if self.records_path else f"record {index} (0-based)"

    def users(self, index: int) -> str | None:
        return self.origins.describe(index) if self.origins is not None else None


def read_records(source: str | Path) -> list[dict[str, str]]:
    """All records from every data file at `source`, in file order."""
    return read_records_with_origins(source)[0]


def read_records_with_origins(source: str | Path) -> tuple[list[dict[str, str]], RecordOrigins]:
    """All records from every data file at `source`, in file order, and where each came from."""
    records: list[dict[str, str]] = []
    origins = RecordOrigins()
    for path in list_source_files(source):
        suffix = path.suffix.lower()
        try:
            if suffix in (".jsonl", ".json"):
                unit, rows = _read_json(path)
            elif suffix == ".csv":
                unit, rows = "line", _read_csv(path)
            else:
                unit, rows = "row", _read_parquet(path)
            origins.files.append((str(path), unit))
            file_index = len(origins.files) - 1
            for record, number in rows:
                records.append(record)
                origins.positions.append((file_index, number))
        except OSError as error:
            raise SourceDataError(f"{path}: cannot be read ({error})") from error
    return records, origins
