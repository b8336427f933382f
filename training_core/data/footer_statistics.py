"""Parquet footer statistics: per row group, the columns' null counts and integer value ranges.

Read with the footer, so free: the reader decides once per dataset which numeric columns widen
to float (null counts), and the cache narrows integers with the ranges instead of scanning them.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

if TYPE_CHECKING:
    from .parquet_files import RowGroupRef


def is_integer_list(kind: pa.DataType) -> bool:
    """A list (plain, large or fixed-size) of integers: the form of a token column."""
    is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    return is_list and pa.types.is_integer(kind.value_type)


def _is_integer_or_integer_list(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or is_integer_list(kind)


def _leaf_count(kind: pa.DataType) -> int:
    """How many Parquet leaf columns store a field of this Arrow type."""
    if isinstance(kind, pa.ExtensionType):
        return _leaf_count(kind.storage_type)
    if pa.types.is_struct(kind):
        return sum(_leaf_count(kind.field(i).type) for i in range(kind.num_fields))
    if pa.types.is_map(kind):
        return _leaf_count(kind.key_type) + _leaf_count(kind.item_type)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _leaf_count(kind.value_type)
    return 1


def top_level_columns(metadata: pq.FileMetaData, schema: pa.Schema) -> list[str]:
    """The top-level column of each Parquet leaf column. Not the leaf path's first dotted part:
    a column name may itself contain dots (``score.v1``)."""
    names = [f.name for f in schema for _ in range(_leaf_count(f.type))]
    if len(names) == metadata.num_columns:
        return names
    # a type we cannot count leaves of: the longest column name the dotted leaf path starts with
    paths = [metadata.schema.column(i).path for i in range(metadata.num_columns)]
    return [max((n for n in schema.names if p == n or p.startswith(n + ".")), key=len, default=p) for p in paths]


def range_leaves(metadata: pq.FileMetaData, schema: pa.Schema, names: list[str]) -> tuple[tuple[str, int, str], ...]:
    """``(column, leaf index, leaf path)`` of the integer (or list-of-integer) columns stored in one
    leaf; ``names``: the top-level column of each leaf."""
    counts, leaves = Counter(names), []
    for leaf, name in enumerate(names):
        if counts[name] == 1 and name in schema.names and _is_integer_or_integer_list(schema.field(name).type):
            leaves.append((name, leaf, metadata.schema.column(leaf).path))
    return tuple(leaves)


def _chunk_range(chunk: pq.ColumnChunkMetaData) -> tuple[int, int] | None:
    stats = chunk.statistics
    if stats is None or not stats.has_min_max or chunk.physical_type not in ("INT32", "INT64"):
        return None
    low, high = stats.min, stats.max
    return (low, high) if isinstance(low, int) and isinstance(high, int) and low <= high else None


def row_group_statistics(
    metadata: pq.FileMetaData, schema: pa.Schema
) -> tuple[tuple[tuple[tuple[str, int, int], ...], ...], set[str], set[str]]:
    """One pass over every row group's column statistics: the integer value ranges (below), the
    columns that hold nulls somewhere in the file, and the optional columns with a chunk that has
    no null count (some writers write no statistics: only decoding could tell).

    Ranges: per row group, ``(column, min, max)`` for each integer (or list-of-integer) column whose chunk
    statistics have a min and max. The cache narrows integers with these instead of scanning them.
    Only what the Parquet reader itself trusts is used: it hides the min/max of writers known to
    write wrong statistics (``has_min_max`` is then false). A column with more than one leaf is
    skipped; a chunk without statistics is left out (the cache then scans that column).
    Parquet integer statistics are exact bounds (only byte arrays may be truncated).
    A row group of 0 rows holds no nulls, whatever its (often missing) statistics say."""
    names = top_level_columns(metadata, schema)
    wanted = {leaf for _, leaf, _ in range_leaves(metadata, schema, names)}
    ranges, has_nulls, unproven = [], set(), set()
    optional = [metadata.schema.column(column).max_definition_level > 0 for column in range(metadata.num_columns)]
    for index in range(metadata.num_row_groups):
        row_group, found = metadata.row_group(index), []
        if row_group.num_rows == 0:  # pandas / pyarrow write empty files as one such group, without statistics
            ranges.append(())
            continue
        for column in range(row_group.num_columns):
            chunk = row_group.column(column)
            stats = chunk.statistics
            name = names[column]
            if stats is None or not stats.has_null_count:
                if optional[column]:
                    unproven.add(name)
                if stats is None:
                    continue
            elif stats.null_count > 0:
                has_nulls.add(name)
            if column in wanted and (value_range := _chunk_range(chunk)) is not None:
                found.append((name, *value_range))
        ranges.append(tuple(found))
    return tuple(ranges), has_nulls, unproven - has_nulls


def current_value_ranges(metadata: pq.FileMetaData, ref: RowGroupRef) -> dict[str, tuple[int, int]]:
    """``column -> (min, max)`` of ``ref``'s integer columns from ``metadata``: the footer of the file
    as it was opened for decoding. The listing's ranges would be stale for a file rewritten since
    then, and narrowing the new values with them would wrap them silently."""
    if ref.index >= metadata.num_row_groups:
        return {}
    row_group, ranges = metadata.row_group(ref.index), {}
    for name, leaf, path in ref.file.range_leaves:
        if leaf < row_group.num_columns and (chunk := row_group.column(leaf)).path_in_schema == path:
            if (value_range := _chunk_range(chunk)) is not None:
                ranges[name] = value_range
    return ranges
