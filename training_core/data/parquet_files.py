"""Parquet sources: list files, read footers, read one row group (with retry).

Everything here works on a ``pyarrow.fs.FileSystem``; fsspec filesystems are wrapped with
``PyFileSystem(FSSpecHandler(...))`` so local paths, ``s3://`` / ``gs://`` URIs and fsspec
instances (e.g. ``memory://``) all take the same code path.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - imported up front: a lazy import (~0.3 s) would stall every decode thread
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from .footer_statistics import is_integer_list  # noqa: F401 - re-exported (the training data preflight uses it)
from .footer_statistics import range_leaves, row_group_statistics, top_level_columns
from .local_folders import is_hidden_or_underscore, is_link_to_nothing, link_to_nothing, walk_local_files

logger = logging.getLogger(__name__)
T = TypeVar("T")

PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")
SIDE_FILE_SUFFIXES = (".crc", ".json", ".txt", ".md", ".tmp")


class RowGroupReadError(RuntimeError):
    """A row group (or a file's footer) could not be read or decoded."""


class ReadTimeoutError(RowGroupReadError, TimeoutError):
    """A storage read did not finish within ``read_timeout_s``."""


class SourceError(ValueError):
    """The source names no readable Parquet data."""


@dataclass(frozen=True)
class ParquetFile:
    """One file: where it is and the version that makes cache keys safe against rewrites."""

    path: str  # path inside the filesystem
    size: int
    mtime_ns: int | None
    row_group_sizes: tuple[int, ...]
    # per row group: (column, min, max) of integer columns whose footer statistics give them
    value_ranges: tuple[tuple[tuple[str, int, int], ...], ...] = field(default=(), compare=False, repr=False)
    # (column, leaf index, leaf path) of the columns whose ranges are read: the footer of the file
    # actually decoded is asked again, since the file may have been rewritten since the listing
    range_leaves: tuple[tuple[str, int, str], ...] = field(default=(), compare=False, repr=False)
    # Where the filesystem reports no mtime (fsspec's memory://, and backends whose info names it
    # otherwise): a digest of the footer (row-group offsets, sizes and statistics), so a file
    # rewritten in place with the same size still gets new cache keys.
    footer_digest: str | None = None

    @property
    def identity(self) -> str:
        if self.mtime_ns is None and self.footer_digest is not None:
            return f"{self.path}|{self.size}|footer:{self.footer_digest}"
        return f"{self.path}|{self.size}|{self.mtime_ns}"


@dataclass(frozen=True)
class RowGroupRef:
    file: ParquetFile
    index: int
    num_rows: int

    def describe(self) -> str:
        return f"{self.file.path} row group {self.index}"

    @property
    def value_ranges(self) -> dict[str, tuple[int, int]]:
        """``column -> (min, max)`` of integer columns, from the footer's statistics (may be empty)."""
        ranges = self.file.value_ranges
        if self.index >= len(ranges):
            return {}
        return {name: (low, high) for name, low, high in ranges[self.index]}


def as_arrow_filesystem(filesystem: Any) -> pafs.FileSystem:
    """Accept a pyarrow or fsspec filesystem and return a pyarrow one."""
    if isinstance(filesystem, pafs.FileSystem):
        return filesystem
    return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem))


def _resolve_one(source: str | os.PathLike, filesystem: Any | None) -> tuple[pafs.FileSystem, str]:
    text = os.fspath(source)
    if filesystem is not None:
        return as_arrow_filesystem(filesystem), text
    if "://" not in text:
        # no mmap: mapped pages would count in RSS and grow with the files read; `~` expands as in
        # sources.list_source_files (a URI's path is the store's, never expanded)
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(text))
    try:
        return pafs.FileSystem.from_uri(text)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError):
        import fsspec.core

        fs, path = fsspec.core.url_to_fs(text)
        return as_arrow_filesystem(fs), path


def _is_side_file(relative: str) -> bool:
    return is_hidden_or_underscore(relative) or PurePosixPath(relative).name.lower().endswith(SIDE_FILE_SUFFIXES)


def _has_parquet_magic(fs: pafs.FileSystem, path: str) -> bool:
    with fs.open_input_file(path) as handle:
        return handle.read(4) == b"PAR1"


def _no_watch(request: str) -> None:
    """The default ``before_request``: nothing watches the storage requests."""


def list_parquet_files(
    source: Any, filesystem: Any | None = None, before_request: Callable[[str], None] = _no_watch
) -> tuple[pafs.FileSystem, list[pafs.FileInfo]]:
    """Expand a file, directory or list of them into sorted Parquet files (side files skipped).
    ``before_request(what)`` is called before each storage request (see :func:`index_dataset`)."""
    sources = list(source) if isinstance(source, (list, tuple)) else [source]
    if not sources:
        raise SourceError("source is an empty list; pass a Parquet file, a directory or a list of them")
    found: dict[str, pafs.FileInfo] = {}
    chosen_fs: pafs.FileSystem | None = None
    for item in sources:
        before_request(f"listing {item}")
        fs, path = _resolve_one(item, filesystem)
        if chosen_fs is not None and fs.type_name != chosen_fs.type_name:
            raise SourceError(f"{item}: all sources must live on one filesystem ({chosen_fs.type_name})")
        chosen_fs = fs
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            if isinstance(fs, pafs.LocalFileSystem) and os.path.islink(path):
                raise SourceError(link_to_nothing(str(item), path))
            raise SourceError(f"{item}: no such file or directory")
        if info.type == pafs.FileType.File:
            found[info.path] = info
            continue
        before_request(f"listing {path}")
        if isinstance(fs, pafs.LocalFileSystem):
            children = fs.get_file_info(_local_files_below(path))
        else:
            children = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        for child in children:
            if child.type != pafs.FileType.File:
                continue
            relative = child.path[len(path.rstrip("/")) + 1 :]
            if _is_side_file(relative):
                continue
            if not child.path.lower().endswith(PARQUET_SUFFIXES):
                before_request(f"magic bytes of {child.path}")
                if not _has_parquet_magic(fs, child.path):
                    logger.debug("skipping %s: not a Parquet file", child.path)
                    continue
            found[child.path] = child
    if not found:
        raise SourceError(f"{source}: no Parquet files found")
    assert chosen_fs is not None
    return chosen_fs, [found[key] for key in sorted(found)]


def _local_files_below(root: str) -> list[str]:
    """Every file below the local folder ``root`` (local_folders.walk_local_files: links followed,
    each real folder once, where pyarrow's listing walks a loop until the OS refuses the path and
    reads each file as often). A link whose target is gone is refused: pyarrow's listing leaves it
    out, and the file it stood for would go unread without a word."""

    def refuse(error: OSError) -> SourceError:
        return SourceError(f"{error.filename}: cannot be listed ({error.strerror or error})")

    files = [os.path.join(root, relative) for relative in walk_local_files(root, refuse)
             if not _is_side_file(relative)]
    if dangling := sorted(file for file in files if is_link_to_nothing(file)):
        raise SourceError("; ".join(link_to_nothing(link, link) for link in dangling))
    return files


def read_footer(fs: pafs.FileSystem, info: pafs.FileInfo, max_attempts: int = 3,
                backoff_s: float = 0.05) -> tuple[ParquetFile, pa.Schema, set[str], set[str]]:
    """Row-group sizes, Arrow schema, the columns that hold nulls somewhere in the file, and the
    optional columns whose footer does not say (no null count in some row group's statistics).
    A storage error is retried like a row group's read; damaged data is not."""

    def read() -> tuple[pq.FileMetaData, pa.Schema]:
        with fs.open_input_file(info.path) as handle:
            metadata = pq.ParquetFile(handle).metadata
            return metadata, metadata.schema.to_arrow_schema()

    metadata, schema = retry_storage_errors(read, f"{info.path} footer", max_attempts, backoff_s)
    ranges, has_nulls, unproven = row_group_statistics(metadata, schema)
    mtime = info.mtime_ns if info.mtime is not None else None
    sizes = tuple(metadata.row_group(i).num_rows for i in range(metadata.num_row_groups))
    leaves = range_leaves(metadata, schema, top_level_columns(metadata, schema))
    footer = _footer_digest(metadata) if mtime is None else None
    file = ParquetFile(info.path, int(info.size or 0), mtime, sizes, ranges, leaves, footer)
    return file, schema, has_nulls, unproven


def _footer_digest(metadata: pq.FileMetaData) -> str:
    """The footer's content (every row group's column chunks: offsets, sizes, statistics), hashed."""
    described = json.dumps(metadata.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def default_columns(schema: pa.Schema) -> list[str]:
    return [name for name in schema.names if not name.startswith("__index_level_")]


def read_row_group_table(
    fs: pafs.FileSystem,
    ref: RowGroupRef,
    columns: Sequence[str],
    handles: dict[str, pq.ParquetFile],
    max_attempts: int = 3,
    backoff_s: float = 0.05,
    deadline: float | None = None,
) -> pa.Table:
    """Read one row group, retrying I/O errors with exponential backoff (bounded by ``deadline``)."""

    def read() -> pa.Table:
        handle = handles.get(ref.file.path)
        if handle is None:
            handle = handles[ref.file.path] = pq.ParquetFile(fs.open_input_file(ref.file.path))
        return handle.read_row_group(ref.index, columns=list(columns), use_threads=False)

    # a failed handle is dropped, so the next attempt reopens the file
    return retry_storage_errors(read, ref.describe(), max_attempts, backoff_s, deadline,
                                on_failure=lambda: handles.pop(ref.file.path, None))


def retry_storage_errors(read: Callable[[], T], what: str, max_attempts: int, backoff_s: float,
                         deadline: float | None = None, on_failure: Callable[[], object] | None = None) -> T:
    """``read()``, tried up to ``max_attempts`` times with exponential backoff (within ``deadline``)
    while it fails with a storage error; damaged data and any other error raise at once. Every
    failure becomes a RowGroupReadError naming ``what``."""
    for attempt in range(1, max_attempts + 1):
        try:
            return read()
        except OSError as error:  # pa.ArrowIOError is OSError
            if on_failure is not None:
                on_failure()
            if _is_damaged_data(error):  # the same bytes decode no better on a second try
                raise RowGroupReadError(f"{what}: cannot decode: {error}") from error
            delay = backoff_s * 2 ** (attempt - 1)
            out_of_time = deadline is not None and time.monotonic() + delay > deadline
            if attempt == max_attempts or out_of_time:
                raise RowGroupReadError(f"{what}: read failed after {attempt} attempt(s): {error}") from error
            logger.warning("%s: read failed (%s); retry %d in %.2fs", what, error, attempt, delay)
            time.sleep(delay)
        except Exception as error:  # noqa: BLE001 - corrupt data etc. is not retried
            if on_failure is not None:
                on_failure()
            raise RowGroupReadError(f"{what}: cannot decode: {error}") from error
    raise AssertionError("unreachable")


# pyarrow raises some decode failures as OSError, like a storage error; these words mark damaged
# data (a thrift page header that does not parse, a bad magic number, a stream cut short).
_DAMAGED_DATA_MARKERS = ("deserialize thrift", "corrupt", "magic bytes", "unexpected end of stream",
                         "page header", "invalid")


def _is_damaged_data(error: OSError) -> bool:
    if isinstance(error, (ConnectionError, TimeoutError)) or error.errno is not None:
        return False  # transport: worth another attempt
    message = str(error).lower()
    return any(marker in message for marker in _DAMAGED_DATA_MARKERS)


@dataclass(frozen=True)
class DatasetIndex:
    """The files, row groups (canonical order: files sorted by path) and columns of a source."""

    filesystem: pafs.FileSystem
    files: tuple[ParquetFile, ...]
    row_groups: tuple[RowGroupRef, ...]
    columns: tuple[str, ...]
    widen_columns: frozenset[str]  # numeric columns that hold (or may hold) nulls somewhere: always float
    # column -> its Arrow type up to what batches cannot tell apart (see ``batch_type``)
    column_types: dict[str, pa.DataType] = field(default_factory=dict, compare=False, repr=False)

    @property
    def row_group_sizes(self) -> np.ndarray:
        return np.array([ref.num_rows for ref in self.row_groups], dtype=np.int64)

    @property
    def num_rows(self) -> int:
        return sum(ref.num_rows for ref in self.row_groups)

    def row_group_sizes_digest(self) -> int:
        """Fingerprint of the row-group sizes, in order: what the sample order depends on besides the
        order settings. Two datasets with one row count but other row groups give other orders.
        An integer below 2**48, so that a reader state stays plain JSON numbers that any parser keeps exact."""
        import hashlib

        digest = hashlib.blake2b(self.row_group_sizes.astype("<i8").tobytes(), digest_size=6).digest()
        return int.from_bytes(digest, "big")

    def digest(self) -> str:
        """Content-version digest from file identities (path, size, mtime) and row-group sizes."""
        import hashlib

        hasher = hashlib.blake2b(digest_size=16)
        for file in self.files:
            hasher.update(f"{file.identity}|{file.row_group_sizes}\n".encode())
        return hasher.hexdigest()


def _is_numeric(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)


def batch_type(kind: pa.DataType) -> pa.DataType:
    """``kind`` up to differences that give the same batch column: dictionary encoding, large or
    view string / binary / list variants, list field names and nullability, fixed-size lists."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if pa.types.is_large_string(kind) or pa.types.is_string_view(kind):
        return pa.string()
    if pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind):
        return pa.binary()
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return pa.list_(batch_type(kind.value_type))
    return kind


def _check_same_types(
    path: str, schema: pa.Schema, columns: Sequence[str], seen: dict[str, tuple[pa.DataType, str]]
) -> None:
    """Refuse a file whose column type differs from an earlier file's: batches of one column would
    change dtype from window to window (int32 / int64 / float), or mix ints and strings in one array.
    Only nullability and encodings that batches cannot tell apart may differ."""
    for name in columns:
        kind = schema.field(name).type
        first = seen.setdefault(name, (kind, path))
        if batch_type(kind) != batch_type(first[0]):
            raise SourceError(
                f"{path}: column {name!r} is {kind} here but {first[0]} in {first[1]}; every file must store a "
                f"column with one type (rewrite one of them with the other's schema, or leave the column out)"
            )


def check_read_columns(ref: RowGroupRef, table: pa.Table, index: "DatasetIndex") -> None:
    """The decoded row group has the listed columns with the listed types; a file rewritten since
    the listing may have lost one (pyarrow then silently reads the columns it has)."""
    missing = [name for name in index.columns if name not in table.column_names]
    if missing:
        raise RowGroupReadError(f"{ref.describe()}: no column(s) {missing} (it has {table.column_names}): was the "
                                f"file rewritten after the reader listed it? Open a new reader")
    for name, kind in index.column_types.items():
        if batch_type(read := table.schema.field(name).type) != kind:
            raise RowGroupReadError(f"{ref.describe()}: column {name!r} is {read}, listed as {kind}: was the file "
                                    f"rewritten after the reader listed it? Open a new reader")


def _common_columns(schemas: Sequence[tuple[str, pa.Schema]]) -> list[str]:
    """With ``columns=None``: every file's columns, which must be the same set. Taking the first
    file's silently dropped a column added in later files, and the same files in the other sort
    order failed as missing a column; the user names the columns to read instead."""
    per_file = [(path, default_columns(schema)) for path, schema in schemas]
    first = per_file[0][1]
    if all(set(names) == set(first) for _, names in per_file):
        return first
    every = sorted({name for _, names in per_file for name in names})
    common = [name for name in first if all(name in names for _, names in per_file)]
    differing = [name for name in every if name not in common]
    shown = []
    for name in differing[:10]:
        with_it = next(path for path, names in per_file if name in names)
        without = next(path for path, names in per_file if name not in names)
        shown.append(f"{name!r} is in {with_it} but not in {without}")
    more = f"; and {len(differing) - 10} more" if len(differing) > 10 else ""
    advice = (f"pass columns=[...] naming the columns to read (every file has {common})" if common
              else "no column is in every file: read the files with different columns separately")
    raise SourceError(f"files have different columns, so columns=None (all of them) is ambiguous: "
                      f"{'; '.join(shown)}{more}; {advice}")


def index_dataset(source: Any, columns: Sequence[str] | None = None, filesystem: Any | None = None,
                  before_request: Callable[[str], None] = _no_watch) -> DatasetIndex:
    """List ``source`` and read every footer. Storage may hang: run it on a thread that a watcher
    can give up on; ``before_request(what)`` is called before each storage request (listing,
    footer read), so the watcher can time each request and stop an abandoned listing there."""
    fs, infos = list_parquet_files(source, filesystem, before_request)
    footers = []
    for info in infos:
        before_request(f"footer of {info.path}")
        footer = read_footer(fs, info)
        if columns is not None and (missing := [name for name in columns if name not in footer[1].names]):
            raise SourceError(f"{info.path}: missing column(s) {missing}; it has {footer[1].names}")
        footers.append((info, *footer))
    if columns is not None:
        chosen = list(columns)
    else:
        chosen = _common_columns([(info.path, schema) for info, _, schema, *_ in footers])
    files, refs, widen = [], [], set()
    types: dict[str, tuple[pa.DataType, str]] = {}  # column -> (type, first file with rows that has it)
    for info, parquet_file, schema, has_nulls, unproven in footers:
        if sum(parquet_file.row_group_sizes):  # an empty file is never read (pandas writes object columns as null)
            _check_same_types(info.path, schema, chosen, types)
        widen |= {name for name in chosen if name in has_nulls and _is_numeric(schema.field(name).type)}
        # A column that may hold nulls widens too, so that its dtype is the same in every batch:
        # deciding per row group would give int batches before the first NULL and float after it.
        if assumed := sorted(name for name in chosen if name in unproven and _is_numeric(schema.field(name).type)):
            widen |= set(assumed)
            logger.warning("%s: no null counts in the Parquet footer for optional column(s) %s: read as float64 "
                           "(they may hold nulls); write the file with statistics, or the columns as "
                           "non-nullable, to keep them integer", info.path, ", ".join(assumed))
        files.append(parquet_file)
        refs.extend(RowGroupRef(parquet_file, i, n) for i, n in enumerate(parquet_file.row_group_sizes) if n > 0)
    column_types = {name: batch_type(kind) for name, (kind, _) in types.items()}
    return DatasetIndex(fs, tuple(files), tuple(refs), tuple(chosen), frozenset(widen), column_types)
