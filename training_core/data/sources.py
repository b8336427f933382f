"""Reading instruction records (`prompt`, `response`) from JSONL, CSV or Parquet files.

A source is a local file or folder, or an fsspec URI; which files of it are read, and which refused,
is `source_files`'s part. Read: `.jsonl` / `.ndjson` (JSON Lines), `.json` (JSON Lines or one
array), `.csv` — each also gzip-compressed (`.jsonl.gz`) — and `.parquet`.

Every malformed record raises `SourceDataError` naming the file (as the user wrote it, URI scheme
included; a URI's password and query values are shown as "***") and line (JSONL/CSV: 1-based line
number, where the row starts; a `.json` array: 0-based item; Parquet: 0-based row index), so the fix
is one edit away. Text files must be UTF-8 (a byte-order mark is allowed).
"""

from __future__ import annotations

import array
import csv
import functools
import gzip
import itertools
import json
import os
import re
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

from training_core.data.source_files import (  # noqa: F401 - list_source_files: the listing, read from here too
    SourceFile,
    chainable_unless_credentials,
    list_source_files,
    redacted_cause,
)
from training_core.errors import SourceDataError
from training_core.redaction import redact_uri

REQUIRED_FIELDS = ("prompt", "response")
ORIGINS_FILE = ".origins.json"  # beside a frozen copy of records: hidden, outside its digest
_BOM = b"\xef\xbb\xbf"  # UTF-8 byte-order mark, as Excel writes it
_GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)  # EOFError: cut short
_CSV_FIELD_LIMIT = 2**31 - 1  # the most csv accepts on every platform (a C long)
_PARQUET_BATCH_ROWS = 4096


def _gzip_error(file: SourceFile, error: Exception) -> SourceDataError:
    return SourceDataError(f"{file}: not a readable gzip file ({error}); was it cut short, or "
                           "named .gz without being compressed?")


def _byte_lines(file: SourceFile) -> Iterator[bytes]:
    """The file's lines as bytes, each ending in b"\n" but maybe the last, read through a file object
    (decompressed as it is read when its name ends in .gz): memory holds one line, not the file."""
    try:
        handle = file.fs.open(file.path, "rb")
    except Exception as error:  # a store's own types too (no credentials, access denied)
        raise SourceDataError(f"{file}: cannot be read ({redacted_cause(error)})") from chainable_unless_credentials(error)
    with handle:
        stream = gzip.GzipFile(fileobj=handle, mode="rb") if file.suffix.endswith(".gz") else handle
        lines = iter(stream)
        while True:
            try:
                line = next(lines)
            except StopIteration:
                return
            except _GZIP_ERRORS as error:  # BadGzipFile is an OSError, so judged before the others
                raise _gzip_error(file, error) from error
            except Exception as error:
                raise SourceDataError(f"{file}: cannot be read ({redacted_cause(error)})") from chainable_unless_credentials(error)
            yield line


def _text_lines(file: SourceFile) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) of the file as UTF-8 text, split at "\n" only (not splitlines():
    U+2028 may sit in a string), endings kept; a leading byte-order mark is dropped. Bytes that are
    not UTF-8 are refused with their line and column."""
    for line_number, data in enumerate(_byte_lines(file), start=1):
        if line_number == 1 and data.startswith(_BOM):
            data = data[len(_BOM):]
        try:
            yield line_number, data.decode("utf-8")
        except UnicodeDecodeError as error:  # "\n" is never part of a multi-byte character
            raise SourceDataError(
                f"line {line_number} of {file}: not UTF-8 (byte 0x{data[error.start]:02x} at column "
                f"{error.start + 1}); save the file as UTF-8"
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


def _read_json(file: SourceFile) -> tuple[str, Iterator[tuple[dict[str, str], int]]]:
    """("item", records of a `.json` array) or ("line", records of JSON Lines). JSON Lines are read a
    line at a time; a `.json` array is parsed whole (its items are one JSON value, so its size bounds
    memory; export large days as JSON Lines)."""
    lines = _text_lines(file)
    if file.format != "json":
        return "line", _read_json_lines(file, lines)
    blank = []  # leading blank lines, read to find out which a .json file holds
    for numbered in lines:
        blank.append(numbered)
        if numbered[1].strip():
            break
    read = itertools.chain(blank, lines)
    if blank and blank[-1][1].lstrip().startswith("["):
        return "item", _read_json_array(file, "".join(line for _, line in read))
    return "line", _read_json_lines(file, read)


def _read_json_lines(file: SourceFile, lines: Iterator[tuple[int, str]]) -> Iterator[tuple[dict[str, str], int]]:
    for line_number, line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            hint = (" (.json files hold JSON Lines, one object per line, or one JSON array)"
                    if file.format == "json" else "")
            raise SourceDataError(f"line {line_number} of {file}: not valid JSON ({error.msg}){hint}") from error
        yield _validated(record, f"line {line_number} of {file}"), line_number


def _read_json_array(file: SourceFile, text: str) -> Iterator[tuple[dict[str, str], int]]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as error:
        raise SourceDataError(f"line {error.lineno} of {file}: not valid JSON ({error.msg})") from error
    for index, item in enumerate(items):
        yield _validated(item, f"item {index} (0-based) of the JSON array in {file}"), index


_CSV_LINE_BREAK = re.compile(r"[^\r]*(?:\r\n?|$)")


def _csv_lines(file: SourceFile) -> Iterator[str]:
    """The file's lines as csv reads them from a file opened with newline="": a lone "\r" ends a
    line too, so csv's line count, and so the line numbers in messages, are those of the whole text.
    (A file whose lines all end in a lone "\r", as classic Mac OS wrote, arrives as one text line.)"""
    for _, line in _text_lines(file):
        if "\r" not in line:
            yield line
            continue
        yield from (match[0] for match in _CSV_LINE_BREAK.finditer(line) if match[0])


def _read_csv(file: SourceFile) -> Iterator[tuple[dict[str, str], int]]:
    # csv's default limit (131,072 characters a field) would call a long but valid record malformed;
    # a record too long to train on is named where it is packed.
    csv.field_size_limit(max(csv.field_size_limit(), _CSV_FIELD_LIMIT))
    reader = csv.reader(_csv_lines(file), strict=True)
    try:
        header = next(reader, [])
    except csv.Error as error:
        raise SourceDataError(f"line 1 of {file}: malformed CSV header ({error})") from error
    missing = [f for f in REQUIRED_FIELDS if f not in header]
    if missing:
        raise SourceDataError(f"{file}: header lacks column(s) {missing}; it has {header}")
    # A repeated name would keep only its last column's cells, silently. Empty names (a spreadsheet's
    # unused trailing columns: "prompt,response,,") name no column to read, so they may repeat.
    if repeated := sorted({name for name in header if name.strip() and header.count(name) > 1}):
        raise SourceDataError(f"line 1 of {file}: column(s) {repeated} appear more than once in the header {header}")
    while True:
        line_number = reader.line_num + 1  # where the next row starts (a quoted field may span lines)
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as error:  # e.g. a quote never closed
            raise SourceDataError(f"line {line_number} of {file}: malformed CSV ({error})") from error
        if not cells:
            continue  # blank line
        # zip would drop extra cells: a response cut at an unquoted comma. Empty ones (a trailing
        # comma a spreadsheet left) hold nothing to lose.
        if len(cells) > len(header) and any(cells[len(header):]):
            raise SourceDataError(f"line {line_number} of {file}: {len(cells)} cells but the header has {len(header)} "
                                  "columns (an unquoted comma? quote fields that contain commas)")
        yield _validated(dict(zip(header, cells)), f"line {line_number} of {file}"), line_number


def _read_parquet(file: SourceFile) -> Iterator[tuple[dict[str, str], int]]:
    """Rows converted one batch at a time: memory holds a batch (and a row group), not the file."""
    try:
        handle = file.fs.open(file.path, "rb")
    except Exception as error:  # a store's own types too (no credentials, access denied)
        raise SourceDataError(f"{file}: cannot be read ({redacted_cause(error)})") from chainable_unless_credentials(error)
    with handle:
        try:
            parquet = pq.ParquetFile(handle)
            names = parquet.schema_arrow.names
        except Exception as error:  # pyarrow raises several types for unreadable files
            raise SourceDataError(
                f"{file}: not a readable Parquet file ({redact_uri(str(error))})") from chainable_unless_credentials(error)
        missing = [f for f in REQUIRED_FIELDS if f not in names]
        if missing:
            raise SourceDataError(f"{file}: schema lacks column(s) {missing}")
        # Read by name, a repeated column would be taken silently (the last one), as no CSV header may repeat one.
        if repeated := [f for f in REQUIRED_FIELDS if names.count(f) > 1]:
            raise SourceDataError(f"{file}: column(s) {repeated} appear more than once in the schema {names}")
        batches = parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=list(REQUIRED_FIELDS))
        row_index = 0
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as error:  # a damaged row group, or the store failing mid-read
                raise SourceDataError(
                    f"{file}: not a readable Parquet file ({redact_uri(str(error))})") from chainable_unless_credentials(error)
            for row in batch.to_pylist():
                yield _validated(row, f"row {row_index} (0-based) of {file}"), row_index
                row_index += 1


class RecordOrigins:
    """Where each record came from: (file, line / array item / row). Kept beside a frozen copy of
    the records (hidden, outside its digest) so that a later error names the user's own file.
    12 bytes a record (two arrays of numbers), not a Python tuple each: a day may be millions."""

    def __init__(self, files: list[tuple[str, str]] | None = None) -> None:
        self.files: list[tuple[str, str]] = list(files or [])  # (path, "line" | "item" | "row")
        self._file_of, self._number_of = array.array("i"), array.array("q")  # per record

    def add(self, file_index: int, number: int) -> None:
        self._file_of.append(file_index)
        self._number_of.append(number)

    def __len__(self) -> int:
        return len(self._file_of)

    def describe(self, index: int) -> str | None:
        if not 0 <= index < len(self):
            return None
        path, unit = self.files[self._file_of[index]]
        number = self._number_of[index]
        return f"line {number} of {path}" if unit == "line" else f"{unit} {number} (0-based) of {path}"

    def save(self, path: Path) -> None:
        """Written whole (temporary file, then a rename): it may replace the origins beside a published
        copy that a concurrent reader is loading. The JSON is written in pieces, never built whole."""
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with temporary.open("w", encoding="utf-8") as handle:
            handle.write(f'{{"files": {json.dumps(self.files)}, "positions": [')
            for start in range(0, len(self), _ORIGINS_CHUNK):
                pairs = zip(self._file_of[start : start + _ORIGINS_CHUNK], self._number_of[start : start + _ORIGINS_CHUNK])
                handle.write(("" if start == 0 else ", ") + ", ".join(f"[{f}, {n}]" for f, n in pairs))
            handle.write("]}")
        os.replace(temporary, path)

    @classmethod
    def load(cls, path: Path) -> "RecordOrigins | None":
        """The origins saved at ``path``; the positions are parsed pair by pair, so memory holds the
        file's text and the two arrays, not a list of lists."""
        try:
            text = path.read_text()
            # As `save` writes it (json.dumps' separators): only numbers follow the last such key.
            head, separator, positions = text.rpartition(', "positions": [')
            if not separator or not positions.rstrip().endswith("]}"):
                return None
            files = json.loads(head + "}")["files"]
            origins = cls([tuple(f) for f in files])
            for match in _POSITION.finditer(positions):
                origins.add(int(match[1]), int(match[2]))
            return origins
        except (OSError, ValueError, KeyError, TypeError):
            return None  # no record of origins (demo data, or frozen before they were kept)


_ORIGINS_CHUNK = 4096
_POSITION = re.compile(r"\[\s*(\d+)\s*,\s*(\d+)\s*\]")


class RecordLocations:
    """Where record ``index`` of a frozen records file (JSON Lines) is, for messages: its line there,
    and its place in the user's own file when the origins were kept beside it (loaded when first
    asked: most datasets never name a record)."""

    def __init__(self, records_path: str | None) -> None:
        self.records_path = records_path

    @functools.cached_property
    def origins(self) -> RecordOrigins | None:
        return RecordOrigins.load(Path(self.records_path).parent / ORIGINS_FILE) if self.records_path else None

    def frozen(self, index: int) -> str:
        return f"line {index + 1} of {self.records_path}" if self.records_path else f"record {index} (0-based)"

    def users(self, index: int) -> str | None:
        return self.origins.describe(index) if self.origins is not None else None


def iter_records(source: str | Path, origins: RecordOrigins | None = None) -> Iterator[dict[str, str]]:
    """Every record from every data file at `source`, in file order, read a line (JSONL, CSV) or a
    batch of rows (Parquet) at a time, so memory holds a batch, not the day (a `.json` array is read
    whole). With `origins`, where each record came from is added to it as the record is yielded."""
    for file in list_source_files(source):
        if file.format in ("jsonl", "json"):
            unit, rows = _read_json(file)
        elif file.format == "csv":
            unit, rows = "line", _read_csv(file)
        else:
            unit, rows = "row", _read_parquet(file)
        if origins is not None:
            origins.files.append((file.location, unit))  # the URI with its scheme (redacted): later messages name it
        file_index = len(origins.files) - 1 if origins is not None else 0
        for record, number in rows:
            if origins is not None:
                origins.add(file_index, number)
            yield record
