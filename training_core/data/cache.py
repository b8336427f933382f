"""Local disk cache of decoded row groups (``diskcache.FanoutCache``) with a hard size quota.

Entry = one decoded row group as raw contiguous NumPy buffers behind a small JSON header, with an
XXH3-64 checksum over everything after the prefix; reading it back is ``np.frombuffer`` views (into
a reused buffer, see :class:`BufferPool`), no unpickling. Integer columns are stored in the narrowest integer type that holds their values
(lossless; token ids of a vocabulary < 65 536 take 2 bytes instead of 4), which halves the bytes
written, checksummed and read; the header keeps the logical dtype, restored when rows are copied
into the shuffle window. Key = (payload format, file path + size + mtime, row group, columns, transform version),
so a rewritten file never serves stale rows. The quota is enforced per shard inside a SQLite
``BEGIN IMMEDIATE`` transaction (check volume → evict or refuse → insert), which is atomic across
processes sharing the directory; diskcache's own culling is switched off (``cull_limit=0``).
Readers store entries from a background :class:`CacheWriter` thread (bounded queue, drops rather
than blocks), so encoding, checksumming and writing stay off the decode path.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import struct
import threading
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import diskcache
import numpy as np
import xxhash

logger = logging.getLogger(__name__)

PAYLOAD_FORMAT = 2  # 2: XXH3-64 checksum (1 was CRC-32); part of every key, so old entries are never read
MAGIC = b"TSR2"
_PREFIX = struct.Struct("<4sIQ")  # magic, header length, xxh3_64 of everything after the prefix
_ALIGN = 64
_SQLITE_SLACK = 16 * 1024  # room for the new row and index pages


class CorruptEntryError(ValueError):
    """A cache entry failed its checksum or structure check."""


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
        if self.size_limit_bytes <= 0:
            raise ValueError(f"CacheConfig.size_limit_bytes must be > 0, got {self.size_limit_bytes}")
        if self.policy not in ("evict", "stop_admitting"):
            raise ValueError(f"CacheConfig.policy must be 'evict' or 'stop_admitting', got {self.policy!r}")
        if self.shards < 1:
            raise ValueError(f"CacheConfig.shards must be >= 1, got {self.shards}")
        if self.write_queue_bytes < 0:
            raise ValueError(f"CacheConfig.write_queue_bytes must be >= 0, got {self.write_queue_bytes}")


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def encode_payload(arrays: dict[str, np.ndarray]) -> bytes:
    """Serialize decoded columns into one checksummed buffer (see module docstring)."""
    return b"".join(encode_chunks(arrays))


class _ChunkReader:
    """File-like view over payload chunks: lets diskcache write them without joining first."""

    def __init__(self, chunks: list) -> None:
        self._chunks = iter(chunks)

    def read(self, _size: int = -1) -> bytes | memoryview:
        return next(self._chunks, b"")


def encode_chunks(arrays: dict[str, np.ndarray]) -> list:
    """The payload as a list of buffers (prefix, header, padding, column buffers)."""
    columns, buffers, cursor = [], [], 0

    def add(buffer: np.ndarray) -> dict[str, int]:
        nonlocal cursor
        start = _aligned(cursor)
        if start > cursor:
            buffers.append(bytes(start - cursor))
        data = memoryview(np.ascontiguousarray(buffer)).cast("B")
        buffers.append(data)
        cursor = start + data.nbytes
        return {"offset": start, "nbytes": data.nbytes}

    for name, array in arrays.items():
        meta: dict[str, Any] = {"name": name, "rows": len(array)}
        if array.dtype != object:
            stored = _narrowed(array)
            meta.update(kind="dense", dtype=stored.dtype.str, logical=array.dtype.str, shape=list(array.shape),
                        data=add(stored))
        elif all(type(item) is str for item in array):
            encoded = [item.encode("utf-8") for item in array]
            offsets = np.concatenate([[0], np.cumsum([len(b) for b in encoded], dtype=np.int64)])
            meta.update(kind="str", offsets=add(offsets), data=add(np.frombuffer(b"".join(encoded), np.uint8)))
        elif _is_ragged_numeric(array):
            dtype = array[0].dtype if len(array) else np.dtype(np.int64)
            offsets = np.concatenate([[0], np.cumsum([len(part) for part in array], dtype=np.int64)])
            values = np.concatenate(list(array)) if len(array) else np.zeros(0, dtype)
            meta.update(kind="ragged", dtype=dtype.str, offsets=add(offsets), data=add(values))
        else:
            meta.update(kind="pickle", data=add(np.frombuffer(pickle.dumps(array, protocol=5), np.uint8)))
        columns.append(meta)
    header = json.dumps({"format": PAYLOAD_FORMAT, "columns": columns}).encode()
    head_end = _PREFIX.size + len(header)
    padding = bytes(_aligned(head_end) - head_end)
    hasher = xxhash.xxh3_64(header)
    hasher.update(padding)
    for buffer in buffers:
        hasher.update(buffer)
    return [_PREFIX.pack(MAGIC, len(header), hasher.intdigest()), header, padding, *buffers]


_NARROW_TYPES = [np.dtype(t) for t in (np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32)]


def _narrowed(array: np.ndarray) -> np.ndarray:
    """The same integers in the smallest dtype that holds them (unchanged if nothing is smaller)."""
    if array.dtype.kind not in "iu" or array.dtype.itemsize == 1 or array.size == 0:
        return array
    low, high = int(array.min()), int(array.max())
    for candidate in _NARROW_TYPES:
        info = np.iinfo(candidate)
        if candidate.itemsize < array.dtype.itemsize and info.min <= low and high <= info.max:
            return array.astype(candidate)
    return array


def _is_ragged_numeric(array: np.ndarray) -> bool:
    if not len(array):
        return False
    first = array[0]
    return all(
        isinstance(item, np.ndarray) and item.ndim == 1 and item.dtype == first.dtype and item.dtype != object
        for item in array
    )


def decode_payload(payload: bytes) -> dict[str, np.ndarray]:
    """Inverse of :func:`encode_payload`, with every column in its logical dtype."""
    views, logical = decode_payload_views(payload)
    return {name: value.astype(logical[name]) if value.dtype != logical[name] else value
            for name, value in views.items()}


def decode_payload_views(payload: bytes | memoryview) -> tuple[dict[str, np.ndarray], dict[str, np.dtype]]:
    """Columns as stored (dense ones are views into ``payload``) and their logical dtypes."""
    payload = memoryview(payload).cast("B")
    if len(payload) < _PREFIX.size:
        raise CorruptEntryError(f"entry of {len(payload)} bytes is shorter than its prefix")
    magic, header_len, digest = _PREFIX.unpack_from(payload)
    if magic != MAGIC or _PREFIX.size + header_len > len(payload):
        raise CorruptEntryError("bad magic or header length")
    if xxhash.xxh3_64_intdigest(payload[_PREFIX.size :]) != digest:
        raise CorruptEntryError("checksum mismatch (corrupt or truncated entry)")
    header = json.loads(bytes(payload[_PREFIX.size : _PREFIX.size + header_len]))
    base = _aligned(_PREFIX.size + header_len)

    def view(ref: dict[str, int], dtype: Any = np.uint8) -> np.ndarray:
        itemsize = np.dtype(dtype).itemsize
        return np.frombuffer(payload, dtype=dtype, count=ref["nbytes"] // itemsize, offset=base + ref["offset"])

    out: dict[str, np.ndarray] = {}
    logical: dict[str, np.dtype] = {}
    for meta in header["columns"]:
        kind, rows = meta["kind"], meta["rows"]
        if kind == "dense":
            out[meta["name"]] = view(meta["data"], meta["dtype"]).reshape(meta["shape"])
            logical[meta["name"]] = np.dtype(meta["logical"])
            continue
        result = np.empty(rows, dtype=object)
        if kind == "pickle":
            result = pickle.loads(view(meta["data"]).tobytes())
        else:
            offsets = view(meta["offsets"], np.int64)
            data = view(meta["data"], np.uint8 if kind == "str" else meta["dtype"])
            raw = data.tobytes() if kind == "str" else None
            if raw is None:
                data = data.copy()  # the rows are views: they must not point into a reused read buffer
            for i in range(rows):
                lo, hi = int(offsets[i]), int(offsets[i + 1])
                result[i] = raw[lo:hi].decode("utf-8") if raw is not None else data[lo:hi]
        out[meta["name"]] = result
        logical[meta["name"]] = result.dtype
    return out, logical


def cache_key(file_identity: str, row_group: int, columns: Sequence[str], transform_version: str) -> str:
    return json.dumps([PAYLOAD_FORMAT, file_identity, row_group, list(columns), transform_version])


def cache_version(dataset_digest: str, columns: Sequence[str] | None, transform_version: str) -> str:
    """Short hex id of what the cache holds: dataset, columns, transform and payload format."""
    blob = json.dumps([PAYLOAD_FORMAT, dataset_digest, list(columns) if columns else None, transform_version])
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


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


class RowGroupCache:
    """Thread-safe handle on the shared cache directory (one per reader or warm-up)."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self._cache = diskcache.FanoutCache(
            str(config.directory),
            shards=config.shards,
            timeout=config.timeout_s,
            size_limit=2**62,  # quota is enforced by _admit, not by diskcache's cull
            cull_limit=0,
            eviction_policy="least-recently-stored",
            statistics=False,
        )
        self._shard_limit = config.size_limit_bytes // config.shards
        self._lock = threading.Lock()
        self.counters = CacheCounters()
        self._files: dict[str, str] = {}  # key -> value file, from :meth:`locate`

    def locate(self, keys: Sequence[str]) -> int:
        """Look up where the value files of ``keys`` are (one query per shard, on this thread), so
        that hits open the file directly instead of a SQLite connection per decode thread and
        shard. Safe against concurrent writers: value files are never rewritten in place (diskcache
        writes a new file and deletes the old one), so a remembered path is either the complete
        entry or gone, and a missing file falls back to a normal lookup. Returns how many it found."""
        found: dict[str, str] = {}
        try:
            for shard in self._cache._shards:  # pinned diskcache 5.6: Cache table (key, raw, filename)
                for begin in range(0, len(keys), 500):
                    chunk = list(keys[begin : begin + 500])
                    marks = ",".join("?" * len(chunk))
                    rows = shard._sql(f"SELECT key, filename FROM Cache WHERE raw = 1 AND key IN ({marks})", chunk)
                    found.update((key, os.path.join(shard.directory, name)) for key, name in rows.fetchall() if name)
        except Exception as error:  # noqa: BLE001 - only an optimization: hits then take the normal path
            logger.debug("row-group cache: locating entries failed (%s); using normal lookups", error)
            found = {}
        self._files = found
        return len(found)

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
        """Store an entry if the quota allows (after evicting, under ``policy="evict"``)."""
        chunks = encode_chunks(arrays)
        size = sum(memoryview(chunk).nbytes for chunk in chunks)
        needed = size + len(key) + _SQLITE_SLACK
        if needed > self._shard_limit:
            self._count(rejected=1)
            return False
        shard = self._cache._shards[self._cache._hash(key) % len(self._cache._shards)]  # pinned diskcache 5.6
        evicted = 0
        with shard.transact(retry=True):
            excess = shard.volume() + needed - self._shard_limit
            if excess > 0 and self.config.policy == "stop_admitting":
                self._count(rejected=1)
                return False
            while excess > 0:
                rows = shard._sql("SELECT key, size FROM Cache ORDER BY store_time LIMIT 16").fetchall()
                if not rows:
                    break
                for old_key, size in rows:
                    if excess <= 0:
                        break
                    if shard.delete(old_key, retry=True):
                        evicted += 1
                        excess -= size
            if excess > 0:  # only SQLite overhead left: cannot make room
                self._count(rejected=1, evictions=evicted)
                return False
            # read=True streams the chunks to the value file (diskcache would split raw bytes at b"\n")
            shard.set(key, _ChunkReader([chunk for chunk in chunks if memoryview(chunk).nbytes]), read=True, retry=True)
        self._count(evictions=evicted, stored_bytes=size)
        return True

    def volume(self) -> int:
        return int(self._cache.volume())

    def __len__(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._cache.close()


class CacheWriter:
    """Background thread that stores decoded row groups (narrow, checksum, quota'd insert).

    :meth:`submit` never blocks: when the row groups already waiting hold ``max_pending_bytes`` or
    more, the new one is not stored and counted in ``counters.dropped`` (it is read from Parquet
    again next time). :meth:`close` stores everything still waiting, then ends the thread, so a
    reader opened afterwards finds the entries. Each entry is written completely before its row
    is committed (see :meth:`RowGroupCache.put`), so stopping never leaves a torn entry.
    """

    def __init__(self, cache: RowGroupCache, name: str, max_pending_bytes: int) -> None:
        self.cache, self.max_pending_bytes = cache, max_pending_bytes
        self._pending: deque = deque()
        self._pending_bytes = 0
        self._closing = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"{name}-cache-writer", daemon=True)
        self._thread.start()

    def submit(self, key: str, arrays: dict[str, np.ndarray]) -> bool:
        nbytes = sum(array.nbytes for array in arrays.values())
        with self._wake:
            if self._closing or (self._pending and self._pending_bytes + nbytes > self.max_pending_bytes):
                self.cache._count(dropped=1)
                return False
            self._pending.append((key, arrays, nbytes))
            self._pending_bytes += nbytes
            self._wake.notify()
        return True

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closing:
                    self._wake.wait()
                if not self._pending:
                    return
                key, arrays, nbytes = self._pending[0]
            try:
                self.cache.put(key, arrays)
            except Exception as error:  # noqa: BLE001 - a failed store only costs a re-read later
                logger.warning("row-group cache: storing an entry failed: %s: %s", type(error).__name__, error)
                self.cache._count(write_errors=1)
            with self._wake:
                self._pending.popleft()
                self._pending_bytes -= nbytes

    def close(self, timeout_s: float = 60.0) -> None:
        """Store what is waiting, then stop the thread (waits at most ``timeout_s``)."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("%s still storing after %.0fs; it exits when the write returns", self._thread.name,
                           timeout_s)


@dataclass
class CacheWarmReport:
    entries: int
    bytes: int
    hits: int
    misses: int
    evictions: int
    corruptions: int
    hit_rate: float
    cache_version: str

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
) -> CacheWarmReport:
    """Decode every row group of ``source`` into the cache; returns what it found and stored."""
    from .workers import load_all_row_groups  # workers imports this module

    return load_all_row_groups(source, cache, columns, workers, dataset_digest, filesystem, read_timeout_s)
