"""Local disk cache of decoded row groups (``diskcache.FanoutCache``) with a hard size quota.

Entry = one decoded row group as raw contiguous NumPy buffers behind a small JSON header, with a
CRC-32 over everything after the checksum field; reading it back is ``np.frombuffer`` views, no
unpickling. Integer columns are stored in the narrowest integer type that holds their values
(lossless; token ids of a vocabulary < 65 536 take 2 bytes instead of 4), which halves the bytes
written, checksummed and read; the header keeps the logical dtype, restored when rows are copied
into the shuffle window. Key = (payload format, file path + size + mtime, row group, columns, transform version),
so a rewritten file never serves stale rows. The quota is enforced per shard inside a SQLite
``BEGIN IMMEDIATE`` transaction (check volume → evict or refuse → insert), which is atomic across
processes sharing the directory; diskcache's own culling is switched off (``cull_limit=0``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import pickle
import struct
import threading
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import diskcache
import numpy as np

logger = logging.getLogger(__name__)

PAYLOAD_FORMAT = 1
MAGIC = b"TSRG"
_PREFIX = struct.Struct("<4sII")  # magic, crc32 of the rest, header length
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
    """

    directory: str | Path
    size_limit_bytes: int
    policy: Literal["evict", "stop_admitting"] = "evict"
    shards: int = 4
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.size_limit_bytes <= 0:
            raise ValueError(f"CacheConfig.size_limit_bytes must be > 0, got {self.size_limit_bytes}")
        if self.policy not in ("evict", "stop_admitting"):
            raise ValueError(f"CacheConfig.policy must be 'evict' or 'stop_admitting', got {self.policy!r}")
        if self.shards < 1:
            raise ValueError(f"CacheConfig.shards must be >= 1, got {self.shards}")


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
    crc = zlib.crc32(header)
    crc = zlib.crc32(padding, crc)
    for buffer in buffers:
        crc = zlib.crc32(buffer, crc)
    return [_PREFIX.pack(MAGIC, crc, len(header)), header, padding, *buffers]


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


def decode_payload_views(payload: bytes) -> tuple[dict[str, np.ndarray], dict[str, np.dtype]]:
    """Columns as stored (dense ones are read-only views into ``payload``) and their logical dtypes."""
    if len(payload) < _PREFIX.size:
        raise CorruptEntryError(f"entry of {len(payload)} bytes is shorter than its prefix")
    magic, crc, header_len = _PREFIX.unpack_from(payload)
    if magic != MAGIC or _PREFIX.size + header_len > len(payload):
        raise CorruptEntryError("bad magic or header length")
    if zlib.crc32(memoryview(payload)[_PREFIX.size :]) != crc:
        raise CorruptEntryError("checksum mismatch (corrupt or truncated entry)")
    header = json.loads(payload[_PREFIX.size : _PREFIX.size + header_len])
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

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)

    def get(self, key: str, label: str) -> tuple[dict[str, np.ndarray], dict[str, np.dtype]] | None:
        """``(columns as stored, logical dtypes)`` or None on a miss / corrupt entry."""
        payload = self._cache.get(key, default=None, retry=True)
        if payload is None:
            self._count(misses=1)
            return None
        try:
            arrays = decode_payload_views(payload)
        except (CorruptEntryError, ValueError, KeyError, pickle.UnpicklingError) as error:
            logger.warning("cache entry for %s is corrupt (%s); dropping it and re-reading", label, error)
            self._cache.delete(key, retry=True)
            self._count(corruptions=1, misses=1)
            return None
        self._count(hits=1)
        return arrays

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
