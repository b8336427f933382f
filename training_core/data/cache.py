"""Local disk cache of decoded row groups (``diskcache.FanoutCache``) with a hard size quota.

An entry is one decoded row group in the checksummed format of :mod:`.cache_payload` (raw NumPy
buffers, integers narrowed); a hit is read into a reused buffer (:class:`BufferPool`) and decoded as
``np.frombuffer`` views. Key = (payload format, file path + size + mtime, row group, columns,
transform version), so a rewritten file never serves stale rows. The quota is enforced per shard
inside a SQLite ``BEGIN IMMEDIATE`` transaction (check volume → evict or refuse → write the value
file → insert its row), which is atomic across processes sharing the directory; diskcache's own
culling is switched off (``cull_limit=0``). :meth:`RowGroupCache.put_many` stores several entries
of a shard in one transaction; readers store from a background
:class:`~training_core.data.cache_writer.CacheWriter` thread.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import pickle
import shutil
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Sequence

import diskcache
import numpy as np

from training_core.errors import TesseraError

from .cache_payload import (
    PAYLOAD_FORMAT,
    CorruptEntryError,
    decode_payload_views,
    encode_chunks,
    narrow_columns,
)

logger = logging.getLogger(__name__)

_SQLITE_SLACK = 16 * 1024  # room for the new row and index pages
_STORAGE_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)  # the value files' and SQLite's, not encoding bugs
# key, columns as they are stored (integers already narrowed), the dtypes they are read back as
Entry = tuple[str, dict[str, np.ndarray], dict[str, np.dtype]]


@dataclass(frozen=True)
class CacheConfig:
    """Where the row-group cache lives and how big it may grow.

    ``policy="evict"`` drops the least recently stored entries to admit a new one;
    ``policy="stop_admitting"`` keeps what is there and stops storing at the quota. The quota is
    split evenly over ``shards`` (an entry larger than ``size_limit_bytes / shards`` is never stored).
    ``write_queue_bytes`` bounds the decoded row groups waiting for the reader's background cache
    writer; when it is full a row group is not stored (counted in ``cache_dropped``) rather than
    making decoding wait. ``0`` stores every entry synchronously on the decode thread.
    """

    directory: str | Path
    size_limit_bytes: int
    policy: Literal["evict", "stop_admitting"] = "evict"
    shards: int = 4
    timeout_s: float = 5.0
    write_queue_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        if not str(self.directory).strip():  # "" would put the cache's shard folders in the working directory
            raise ValueError("CacheConfig.directory is empty; give the folder the cache lives in")
        if Path(self.directory).exists() and not Path(self.directory).is_dir():
            raise ValueError(f"CacheConfig.directory {self.directory} is a file, not a folder")
        for name in ("size_limit_bytes", "shards", "write_queue_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"CacheConfig.{name} must be a whole number of {'bytes' if 'bytes' in name else 'shards'}, "
                                 f"got {value!r}")
        if self.size_limit_bytes <= 0:
            raise ValueError(f"CacheConfig.size_limit_bytes must be > 0, got {self.size_limit_bytes}")
        if self.policy not in ("evict", "stop_admitting"):
            raise ValueError(f"CacheConfig.policy must be 'evict' or 'stop_admitting', got {self.policy!r}")
        if self.shards < 1:
            raise ValueError(f"CacheConfig.shards must be >= 1, got {self.shards}")
        if self.write_queue_bytes < 0:
            raise ValueError(f"CacheConfig.write_queue_bytes must be >= 0, got {self.write_queue_bytes}")


def cache_key(file_identity: str, row_group: int, columns: Sequence[str], transform_version: str,
              widened: Sequence[str] = ()) -> str:
    """``widened``: the columns decoded as float because some file of the dataset may hold nulls
    in them (the same row group decodes as int in a dataset without); empty keeps the old key."""
    parts = [PAYLOAD_FORMAT, file_identity, row_group, list(columns), transform_version]
    return json.dumps(parts + [sorted(widened)] if widened else parts)


def cache_version(dataset_digest: str, columns: Sequence[str] | None, transform_version: str) -> str:
    """Short hex id of what the cache holds: dataset, columns, transform and payload format."""
    blob = json.dumps([PAYLOAD_FORMAT, dataset_digest, list(columns) if columns else None, transform_version])
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


class CacheStorageError(TesseraError):
    """The cache folder cannot be opened or written (disk full, no permission, locked too long)."""


def storage_failure(config: CacheConfig, action: str, error: BaseException) -> CacheStorageError:
    """An error naming the cache folder: a bare ``[Errno 28]`` on a decode thread read as the dataset's fault."""
    full = (error.errno in (errno.ENOSPC, errno.EDQUOT) if isinstance(error, OSError)
            else isinstance(error, sqlite3.Error) and "is full" in str(error))  # SQLITE_FULL
    cause = f"{type(error).__name__}: {error}"
    if not full:
        return CacheStorageError(f"row-group cache {config.directory}: {action} failed ({cause})")
    with contextlib.suppress(OSError):
        cause += f"; {shutil.disk_usage(config.directory).free / 2**20:.1f} MiB free there"
    return CacheStorageError(
        f"row-group cache {config.directory}: {action} failed: the disk is full ({cause}); free space there, lower the "
        f"cache's quota (cache.size_limit_bytes={config.size_limit_bytes}) below what the disk holds, or move the cache"
    )


@dataclass
class CacheCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    corruptions: int = 0
    rejected: int = 0
    stored_bytes: int = 0
    dropped: int = 0  # not stored: the background writer's queue was full (or it was closed)
    write_errors: int = 0


class BufferPool:
    """Reusable read buffers for cache hits.

    A fresh ``bytes`` per hit costs more than the read itself (first touch of new pages); a buffer
    given back with :meth:`release` is reused by the next hit. The pool never holds more buffers
    than were out at once (bounded by the row groups in flight).
    """

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for i, buffer in enumerate(self._free):
                if buffer.nbytes >= nbytes:
                    return self._free.pop(i)
            if self._free:
                self._free.pop()  # too small: let it go, a bigger one replaces it
        return np.empty(max(nbytes, 1), dtype=np.uint8)

    def release(self, buffer: np.ndarray | None) -> None:
        if buffer is not None:
            with self._lock:
                self._free.append(buffer)


class _ChunkReader:
    """File-like view over payload chunks: lets diskcache write them without joining first."""

    def __init__(self, chunks: list) -> None:
        self._chunks = iter(chunks)

    def read(self, _size: int = -1) -> bytes | memoryview:
        return next(self._chunks, b"")


class _ValueDisk(diskcache.Disk):
    """diskcache's ``Disk`` with value files in 16 fixed subdirectories of the shard.

    Stock diskcache puts every value file in a random two-level directory (65 536 of them), so
    nearly every store of a young cache pays two ``mkdir`` calls (a fifth of a 1 MB store here).
    Rows keep the relative file name, so any diskcache handle reads these entries. Remembers the
    files it created while a batch is open (:meth:`RowGroupCache.put_many`), so that the files of a
    rolled-back transaction can be deleted and those of a committed one remembered for hits.
    """

    def __init__(self, directory: str, **kwargs: Any) -> None:
        super().__init__(directory, **kwargs)
        self.batch = threading.local()

    def filename(self, key: Any = None, value: Any = None) -> tuple[str, str]:
        name = os.urandom(16).hex()
        relative = os.path.join(name[0], f"{name}.val")  # 16 subdirectories: 0 … f
        full_path = os.path.join(self._directory, relative)
        created = getattr(self.batch, "created", None)
        if created is not None:
            created.append(full_path)
        return relative, full_path


class RowGroupCache:
    """Thread-safe handle on the shared cache directory (one per reader or warm-up)."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        try:  # creates the shard folders and their SQLite files: a full disk fails here
            self._cache = diskcache.FanoutCache(
                str(config.directory), shards=config.shards, timeout=config.timeout_s, disk=_ValueDisk,
                size_limit=2**62,  # the quota is enforced by put_many, not by diskcache's cull
                cull_limit=0, eviction_policy="least-recently-stored", statistics=False,
            )
        except _STORAGE_ERRORS as error:
            raise storage_failure(config, "opening it", error) from error
        self._shard_limit = config.size_limit_bytes // config.shards
        self._lock = threading.Lock()
        self.counters = CacheCounters()
        self._files: dict[str, str] = {}  # key -> value file, from :meth:`locate` and this handle's stores

    def locate(self, keys: Sequence[str]) -> int:
        """Look up where the value files of ``keys`` are (each shard queried for its own keys, on this thread), so
        that hits open the file directly instead of a SQLite connection per decode thread and
        shard. Safe against concurrent writers: value files are never rewritten in place (diskcache
        writes a new file and deletes the old one), so a remembered path is either the complete
        entry or gone, and a missing file falls back to a normal lookup. Returns how many it found."""
        found: dict[str, str] = {}
        try:
            for shard, rows in self._rows_of(keys, "key, filename", "raw = 1 AND"):
                found.update((key, os.path.join(shard.directory, name)) for key, name in rows if name)
        except Exception as error:  # noqa: BLE001 - only an optimization: hits then take the normal path
            logger.debug("row-group cache: locating entries failed (%s); using normal lookups", error)
            found = {}
        self._files = found
        return len(found)

    def stored(self, keys: Sequence[str]) -> tuple[int, int]:
        """(entries, payload bytes) of ``keys`` present in the cache: what one dataset holds in a
        directory other datasets and configurations share."""
        entries = size = 0
        for _, rows in self._rows_of(keys, "COUNT(*), SUM(size)"):
            ((count, total),) = rows
            entries, size = entries + count, size + (total or 0)
        return entries, size

    def _rows_of(self, keys: Sequence[str], columns: str, condition: str = "") -> Iterator[tuple[Any, list]]:
        """``(shard, rows)`` of ``SELECT columns FROM Cache WHERE condition key IN (…)`` for ``keys``,
        each shard asked only for its own keys, 500 at a time (pinned diskcache 5.6: Cache table)."""
        groups: dict[int, list[str]] = {}
        for key in keys:
            groups.setdefault(self._shard_of(key), []).append(key)
        for index, shard_keys in groups.items():
            shard = self._cache._shards[index]
            for begin in range(0, len(shard_keys), 500):
                chunk = shard_keys[begin : begin + 500]
                marks = ",".join("?" * len(chunk))
                yield shard, shard._sql(f"SELECT {columns} FROM Cache WHERE {condition} key IN ({marks})", chunk).fetchall()

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)

    def get(self, key: str, label: str) -> tuple[dict[str, np.ndarray], dict[str, np.dtype]] | None:
        """``(columns as stored, logical dtypes)`` or None on a miss / corrupt entry."""
        found = self.get_pooled(key, label, None)
        return None if found is None else found[:2]

    def get_pooled(
        self, key: str, label: str, buffers: BufferPool | None
    ) -> tuple[dict[str, np.ndarray], dict[str, np.dtype], np.ndarray | None] | None:
        """Like :meth:`get`, reading the entry into a buffer of ``buffers``; the third item is that
        buffer (dense columns are views into it): give it back with ``buffers.release`` once the
        columns have been copied out."""
        found = None
        path = self._files.get(key) if buffers is not None else None
        if path is not None:
            try:
                found = open(path, "rb")  # noqa: SIM115 - closed below
            except OSError:  # evicted since :meth:`locate`
                self._files.pop(key, None)
        if found is None:
            found = self._cache.get(key, default=None, read=buffers is not None, retry=True)
        if found is None:
            self._count(misses=1)
            return None
        buffer = None
        try:
            if isinstance(found, (bytes, bytearray, memoryview)):  # small entries live inside SQLite
                payload = found
            else:  # an open value file (read=True): read it into a reused buffer
                with found:
                    size = os.fstat(found.fileno()).st_size
                    buffer = buffers.acquire(size)
                    payload = memoryview(buffer)[: found.readinto(memoryview(buffer)[:size])]
            arrays, logical = decode_payload_views(payload)
        except (CorruptEntryError, ValueError, KeyError, pickle.UnpicklingError, OSError) as error:
            logger.warning("cache entry for %s is corrupt (%s); dropping it and re-reading", label, error)
            self._files.pop(key, None)
            if buffers is not None:
                buffers.release(buffer)
            self._cache.delete(key, retry=True)
            self._count(corruptions=1, misses=1)
            return None
        self._count(hits=1)
        return arrays, logical, buffer

    def put(self, key: str, arrays: dict[str, np.ndarray]) -> bool:
        """Store one entry if the quota allows (after evicting, under ``policy="evict"``); see :meth:`store`.

        Integer columns are narrowed first (by a scan of their values)."""
        logical = {name: array.dtype for name, array in arrays.items()}
        return self.store(key, narrow_columns(arrays), logical)

    def store(self, key: str, columns: dict[str, np.ndarray], logical: dict[str, np.dtype]) -> bool:
        """:meth:`put` for columns already narrowed (see :data:`Entry`). A failed write (full disk, …) raises
        :class:`CacheStorageError`: cache warming, whose output is the cache, stores this way."""
        try:
            return self._store_in_shard(self._shard_of(key), [(key, columns, logical)])[0]
        except _STORAGE_ERRORS as error:
            raise storage_failure(self.config, "storing a row group", error) from error

    def put_many(self, entries: Sequence[Entry]) -> list[bool]:
        """Store several ``(key, stored columns, logical dtypes)`` (see :data:`Entry`), those of one
        shard in one transaction; returns which were stored.

        The quota check runs before each insert inside the transaction, so a batch obeys the quota
        exactly as single stores do. A failure (full disk, …) never raises (training stores this way): it costs
        only that shard's entries of this call, counted in ``write_errors``, logged, read from Parquet again."""
        stored = [False] * len(entries)
        groups: dict[int, list[int]] = {}
        for position, entry in enumerate(entries):
            groups.setdefault(self._shard_of(entry[0]), []).append(position)
        for shard, positions in groups.items():
            try:
                results = self._store_in_shard(shard, [entries[position] for position in positions])
            except Exception as error:  # noqa: BLE001 - a failed store only costs a re-read later
                logger.warning("%s; not cached, read from Parquet again next time",
                               storage_failure(self.config, f"storing {len(positions)} row group(s)", error))
                self._count(write_errors=len(positions))
                continue
            for position, result in zip(positions, results):
                stored[position] = result
        return stored

    def _shard_of(self, key: str) -> int:
        return self._cache._hash(key) % len(self._cache._shards)  # pinned diskcache 5.6

    def _store_in_shard(self, shard_index: int, entries: Sequence[Entry]) -> list[bool]:
        """Encode every entry (header + checksum) and drop those larger than a shard, then one
        ``BEGIN IMMEDIATE`` transaction; per entry: measure the volume, evict or refuse, write the
        value file, insert the row. The row commits after its file is complete, so no reader, in this
        process or another, ever sees a torn entry; on failure the transaction rolls back and the
        files it wrote are deleted. Rows evicted or replaced are deleted inside the transaction, but
        their value files only after the commit (:meth:`_drop_row`). After the commit the stored
        entries' value files are remembered (like :meth:`locate`), so that later hits on this
        handle open them directly."""
        shard = self._cache._shards[shard_index]
        disk: _ValueDisk = shard.disk
        # encoding and checksumming happen outside the cross-process lock
        prepared: list[tuple[str, list, int, int] | None] = []
        for key, columns, logical in entries:
            chunks = [chunk for chunk in encode_chunks(columns, logical) if memoryview(chunk).nbytes]
            size = sum(memoryview(chunk).nbytes for chunk in chunks)
            needed = size + len(key) + _SQLITE_SLACK
            prepared.append(None if needed > self._shard_limit else (key, chunks, size, needed))
        results, evicted, stored_bytes = [], 0, 0
        created: list[str] = []
        files: dict[str, str] = {}  # key -> value file written in this transaction
        evicted_keys: list[str] = []
        unreferenced: list[str] = []  # value files of rows deleted in this transaction, removed once it commits
        disk.batch.created = created
        try:
            with shard.transact(retry=True):
                for item in prepared:
                    if item is None:
                        results.append(False)
                        continue
                    key, chunks, size, needed = item
                    excess = shard.volume() + needed - self._shard_limit
                    # evicting frees only the entries' bytes (diskcache's "size" setting), never the shard's
                    # SQLite pages: an entry that cannot fit next to those pages is refused before evicting
                    if excess > 0 and (self.config.policy == "stop_admitting" or excess > shard.reset("size")):
                        results.append(False)
                        continue
                    while excess > 0:
                        rows = shard._sql("SELECT rowid, key, size, filename FROM Cache ORDER BY store_time LIMIT 16").fetchall()
                        if not rows:
                            break
                        for rowid, old_key, old_size, filename in rows:
                            if excess <= 0:
                                break
                            self._drop_row(shard, rowid, filename, unreferenced)
                            evicted += 1
                            excess -= old_size
                            evicted_keys.append(old_key)
                            files.pop(old_key, None)
                    if excess > 0:  # rows out of step with the "size" setting: cannot make room
                        results.append(False)
                        continue
                    # an entry already there (another process stored it meanwhile) is replaced: drop its row here,
                    # so that diskcache's set inserts and never deletes the old file before the commit
                    for rowid, filename in shard._sql("SELECT rowid, filename FROM Cache WHERE key = ? AND raw = ?",
                                                      disk.put(key)).fetchall():
                        self._drop_row(shard, rowid, filename, unreferenced)
                    written = len(created)
                    # read=True streams the chunks to the value file (diskcache would split raw bytes at b"\n")
                    shard.set(key, _ChunkReader(chunks), read=True, retry=True)
                    if len(created) > written:  # read=True always writes a value file (pinned diskcache 5.6)
                        files[key] = created[-1]
                    results.append(True)
                    stored_bytes += size
        except BaseException:
            # rolled back: the dropped rows are back and keep their files; only this batch's files go
            for path in created:
                with contextlib.suppress(OSError):
                    os.remove(path)
            raise
        finally:
            disk.batch.created = None
        # committed; a process killed before this point leaves these files as orphans (remove_orphan_files)
        for filename in unreferenced:
            disk.remove(filename)  # suppresses OSError, like diskcache's own cleanup
        for key in evicted_keys:
            self._files.pop(key, None)
        self._files.update(files)
        self._count(evictions=evicted, stored_bytes=stored_bytes, rejected=results.count(False))
        return results

    @staticmethod
    def _drop_row(shard: diskcache.Cache, rowid: int, filename: str | None, unreferenced: list[str]) -> None:
        """Delete one row inside the open transaction and note its value file for after the commit.

        Not ``shard.delete``: nested in our transaction, diskcache removes the value file at once,
        so a rollback (a later store of the batch fails, the process is killed) would bring back a
        row whose file is gone. diskcache's triggers keep its count and size settings (and so
        ``volume()``) in step with a plain ``DELETE`` (pinned diskcache 5.6: Cache table)."""
        shard._sql("DELETE FROM Cache WHERE rowid = ?", (rowid,))
        if filename is not None:  # small values live in the row itself
            unreferenced.append(filename)

    def volume(self) -> int:
        return int(self._cache.volume())

    def remove_orphan_files(self, min_age_s: float = 600.0) -> int:
        """Delete value files no entry refers to: a process killed between writing an entry's file
        and committing its row leaves one behind, never read and outside ``volume()``, so the
        directory would outgrow the quota. Only files older than ``min_age_s`` go, so that a
        writer's open transaction (its file exists before its row) is never touched. Returns how
        many were removed."""
        removed, now = 0, time.time()
        for shard in self._cache._shards:  # pinned diskcache 5.6: value files under the shard folder
            referenced = {os.path.normpath(os.path.join(shard.directory, name))
                          for (name,) in shard._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL").fetchall()}
            for folder, _, names in os.walk(shard.directory):
                for name in names:
                    path = os.path.normpath(os.path.join(folder, name))
                    if not name.endswith(".val") or path in referenced:
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        if now - os.stat(path).st_mtime >= min_age_s:
                            os.remove(path)
                            removed += 1
        return removed

    def __len__(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._cache.close()


@dataclass
class CacheWarmReport:
    entries: int  # this dataset's row groups in the cache (the directory may hold other datasets too)
    bytes: int  # their payload bytes
    hits: int
    misses: int
    evictions: int
    corruptions: int
    hit_rate: float
    cache_version: str
    orphan_files_removed: int = 0  # value files left by killed writers, removed before warming

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def warm_cache(
    source: Any,
    cache: CacheConfig,
    columns: Sequence[str] | None = None,
    workers: int = 2,
    dataset_digest: str | None = None,
    *,
    filesystem: Any | None = None,
    read_timeout_s: float = 60.0,
    transform: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
    transform_version: str = "none",
) -> CacheWarmReport:
    """Decode every row group of ``source`` into the cache; returns what it found and stored.
    ``transform`` / ``transform_version``: those of the reader that will read the cache (see
    :class:`~training_core.data.RowGroupReader`); its entries are stored, and found, under that version."""
    from .workers import load_all_row_groups  # workers imports this module

    return load_all_row_groups(source, cache, columns, workers, dataset_digest, filesystem, read_timeout_s,
                               transform, transform_version)
