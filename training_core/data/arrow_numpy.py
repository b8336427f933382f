"""Arrow → NumPy: one row group's columns as batch arrays, per the reader's batch-column rules
(DESIGN.md; docs/loader.md, "Batch columns"). Runs in the decode threads."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - imported up front: a lazy import (~0.3 s) would stall every decode thread

from .parquet_files import RowGroupReadError


def _numpy_dtype(kind: pa.DataType) -> np.dtype | None:
    """NumPy dtype of a fixed-width integer / float Arrow type (None for anything else)."""
    if pa.types.is_floating(kind):
        return np.dtype(f"f{kind.bit_width // 8}")
    if pa.types.is_integer(kind):
        return np.dtype(f"{'u' if pa.types.is_unsigned_integer(kind) else 'i'}{kind.bit_width // 8}")
    return None


def _to_numpy(array: pa.Array) -> np.ndarray:
    """``array.to_numpy(zero_copy_only=False)``, but a null-free integer / float array becomes a view of
    its data buffer directly: pyarrow's own ``to_numpy`` imports pandas on its first call (~0.13 s,
    which would land on the first row group every process decodes)."""
    dtype = _numpy_dtype(array.type)
    if dtype is None or array.null_count:
        return array.to_numpy(zero_copy_only=False)
    data = array.buffers()[1]
    if data is None:
        return np.zeros(0, dtype)
    return np.frombuffer(data, dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)


def _list_to_numpy(array: pa.Array) -> np.ndarray:
    count = len(array)
    if pa.types.is_fixed_size_list(array.type) and array.null_count == 0:
        return _to_numpy(array.flatten()).reshape(count, array.type.list_size)
    values = _to_numpy(array.flatten())
    if array.null_count == 0:
        offsets = _to_numpy(array.offsets)
        offsets = offsets - offsets[0]
    else:  # null lists become empty arrays
        lengths = np.asarray(array.value_lengths().fill_null(0), dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
    lengths = np.diff(offsets)
    if count and (lengths == lengths[0]).all():
        return values.reshape(count, int(lengths[0]))
    out = np.empty(count, dtype=object)
    for i, part in enumerate(np.split(values, offsets[1:-1])):
        out[i] = part
    return out


def arrow_to_numpy(array: pa.Array | pa.ChunkedArray, widen_nulls: bool = False) -> np.ndarray:
    """Convert one column per the reader's rules (see docs/loader.md, "Batch columns")."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
    kind = array.type
    if pa.types.is_dictionary(kind):
        array, kind = array.dictionary_decode(), kind.value_type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _list_to_numpy(array)
    numeric = pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
    if numeric and (array.null_count > 0 or widen_nulls):
        if not pa.types.is_floating(kind):
            # lossy by contract: an integer beyond ±2**53 becomes the nearest float64 (a safe cast
            # refuses it, which failed the read mid-epoch; docs/loader.md, "Batch columns")
            array = array.cast(pa.float64(), safe=False)
        return array.to_numpy(zero_copy_only=False)
    return _to_numpy(array)


def table_to_numpy(table: pa.Table, widen_columns: set[str] | frozenset[str] = frozenset(),
                   what: str = "row group") -> dict[str, np.ndarray]:
    """Every column of ``table`` per :func:`arrow_to_numpy`; a failure names ``what`` and the column."""
    out = {}
    for name in table.column_names:
        try:
            out[name] = arrow_to_numpy(table.column(name), name in widen_columns)
        except (pa.ArrowException, ValueError, TypeError) as error:
            kind = table.schema.field(name).type
            raise RowGroupReadError(f"{what}: column {name!r} ({kind}) cannot be converted to NumPy: "
                                    f"{type(error).__name__}: {error}") from error
    return out
