"""Cache entry format: decoded columns as raw NumPy buffers behind a small JSON header.

Layout: prefix (magic, header length, XXH3-64 of everything after the prefix), JSON header,
padding, then each column's buffers 64-byte aligned. Reading it back is ``np.frombuffer`` views,
no unpickling. Integer columns are stored in the narrowest integer type that holds their values
(lossless; token ids of a vocabulary < 65 536 take 2 bytes instead of 4); the header keeps the
logical dtype, restored when rows are copied into the shuffle window. The value range that picks
the stored type comes from the Parquet row group's column statistics when the caller has them
(free: the footer is already parsed) and from a min/max scan otherwise.
"""
from __future__ import annotations

import json
import pickle
import struct
from typing import Any, Callable, Mapping

import numpy as np
import xxhash

PAYLOAD_FORMAT = 2  # 2: XXH3-64 checksum (1 was CRC-32); part of every key, so old entries are never read
MAGIC = b"TSR2"
_PREFIX = struct.Struct("<4sIQ")  # magic, header length, xxh3_64 of everything after the prefix
_ALIGN = 64
_NARROW_TYPES = [np.dtype(t) for t in (np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32)]

ValueRanges = Mapping[str, tuple[int, int]]  # column -> (min, max) of its integer values


class CorruptEntryError(ValueError):
    """A cache entry failed its checksum or structure check."""


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def narrow_dtype(array: np.ndarray, value_range: tuple[int, int] | None = None) -> np.dtype:
    """The smallest integer dtype that holds every value of ``array`` (its own dtype if none is smaller).

    ``value_range`` = ``(min, max)`` known from elsewhere (Parquet statistics) skips the scan."""
    if array.dtype.kind not in "iu" or array.dtype.itemsize == 1 or array.size == 0:
        return array.dtype
    low, high = value_range if value_range is not None else (int(array.min()), int(array.max()))
    for candidate in _NARROW_TYPES:
        info = np.iinfo(candidate)
        if candidate.itemsize < array.dtype.itemsize and info.min <= low and high <= info.max:
            return candidate
    return array.dtype


def narrow_columns(
    arrays: dict[str, np.ndarray],
    value_ranges: ValueRanges | None = None,
    allocate: Callable[[tuple[int, ...], np.dtype], np.ndarray] = np.empty,
) -> dict[str, np.ndarray]:
    """Every integer column in its narrowest dtype (others unchanged); see :func:`narrow_dtype`.
    ``allocate(shape, dtype)`` makes the narrow copies."""
    ranges, out = value_ranges or {}, {}
    for name, array in arrays.items():
        dtype = narrow_dtype(array, ranges.get(name))
        if dtype == array.dtype:
            out[name] = array
            continue
        out[name] = allocate(array.shape, dtype)
        np.copyto(out[name], array, casting="unsafe")  # lossless: every value fits ``dtype``
    return out


def encode_payload(arrays: dict[str, np.ndarray], value_ranges: ValueRanges | None = None) -> bytes:
    """Serialize decoded columns into one checksummed buffer, integers narrowed (see module docstring)."""
    logical = {name: array.dtype for name, array in arrays.items()}
    return b"".join(encode_chunks(narrow_columns(arrays, value_ranges), logical))


def encode_chunks(columns: dict[str, np.ndarray], logical: dict[str, np.dtype] | None = None) -> list:
    """The payload of ``columns`` stored as they are (narrow them first with :func:`narrow_columns`)
    as a list of buffers (prefix, header, padding, column buffers), never joined: the cache writes
    them to the value file one after another. ``logical``: the dtypes the columns are read back as."""
    columns_meta, buffers, cursor = [], [], 0

    def add(buffer: np.ndarray) -> dict[str, int]:
        nonlocal cursor
        start = _aligned(cursor)
        if start > cursor:
            buffers.append(bytes(start - cursor))
        contiguous = np.ascontiguousarray(buffer)
        if contiguous.dtype.kind in "mM":  # datetime64 / timedelta64: no buffer format; the header keeps the dtype
            contiguous = contiguous.view(np.int64)
        data = memoryview(contiguous).cast("B")
        buffers.append(data)
        cursor = start + data.nbytes
        return {"offset": start, "nbytes": data.nbytes}

    for name, array in columns.items():
        meta: dict[str, Any] = {"name": name, "rows": len(array)}
        if array.dtype != object:
            dtype = np.dtype(logical[name]) if logical is not None else array.dtype
            meta.update(kind="dense", dtype=array.dtype.str, logical=dtype.str, shape=list(array.shape),
                        data=add(array))
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
        columns_meta.append(meta)
    header = json.dumps({"format": PAYLOAD_FORMAT, "columns": columns_meta}).encode()
    head_end = _PREFIX.size + len(header)
    padding = bytes(_aligned(head_end) - head_end)
    hasher = xxhash.xxh3_64(header)
    hasher.update(padding)
    for buffer in buffers:
        hasher.update(buffer)
    return [_PREFIX.pack(MAGIC, len(header), hasher.intdigest()), header, padding, *buffers]


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
