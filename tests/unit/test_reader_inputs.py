"""What RowGroupReader accepts and what its batches hold: the batch-column rules (DESIGN.md) on files
of other writers (pandas, DuckDB, Spark-style folders; compression, nulls, ragged lists), sources
(lists, fsspec URIs, `~`), and files that disagree on columns or cannot be converted."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training_core.data import CacheConfig, RowGroupReader
from training_core.data.parquet_files import SourceError

from .conftest import read_ids, write_ids_dataset

BIG = 1_733_000_000_123_456_789  # an int64 nanosecond timestamp / 64-bit id: not exactly a float64


def test_batch_columns_follow_the_rules(tmp_path):
    table = pa.table({
        "i": pa.array([1, None, 3, 4], pa.int32()),
        "f": pa.array([1.5, 2.5, None, 4.0], pa.float32()),
        "s": pa.array(["a", "bé", "", "d"]),
        "fixed": pa.array([[1, 2], [3, 4], [5, 6], [7, 8]], pa.list_(pa.int64())),
        "ragged": pa.array([[1], [2, 3], [], [4, 5, 6]], pa.list_(pa.int16())),
    })
    pq.write_table(table, tmp_path / "mixed.parquet", row_group_size=2)
    with RowGroupReader(tmp_path / "mixed.parquet", batch_size=4, shuffle=False) as reader:
        (batch,) = list(reader)
    assert batch["i"].dtype == np.float64 and np.isnan(batch["i"][1]) and batch["i"][2] == 3
    assert batch["f"].dtype == np.float32 and np.isnan(batch["f"][2])
    assert batch["s"].dtype == object and list(batch["s"]) == ["a", "bé", "", "d"]
    assert batch["fixed"].shape == (4, 2) and batch["fixed"][3, 1] == 8
    assert batch["ragged"].dtype == object and batch["ragged"][3].tolist() == [4, 5, 6]
    with RowGroupReader(tmp_path / "mixed.parquet", batch_size=1, shuffle=False, columns=["ragged"]) as reader:
        shapes = [batch["ragged"].shape for batch in reader]
    assert shapes == [(1, 1), (1, 2), (1, 0), (1, 3)]  # one row per batch: lengths agree → 2-D


def test_a_list_of_strings_column_whose_lists_share_one_length_is_read(tmp_path):
    """Such a row group decodes to a 2-D object array, which the window assembly could not scatter
    into its 1-D column of rows; it must follow the list rules like any other list column."""
    uniform = [["a", "b"], ["c", "d"], ["e", "f"], ["g", "h"]]
    ragged = [["i"], ["j", "k", "l"], [], ["m", None]]
    pq.write_table(pa.table({"id": range(8), "tags": uniform + ragged}), tmp_path / "tags.parquet", row_group_size=4)
    expected = uniform + ragged
    cache = CacheConfig(tmp_path / "cache", 1 << 30)
    for options in [dict(shuffle=False), dict(shuffle=True, seed=3), dict(cache=cache), dict(cache=cache)]:
        with RowGroupReader(tmp_path / "tags.parquet", batch_size=4, shuffle_buffer_row_groups=1, **options) as reader:
            batches = list(reader)
        rows = {i: list(tags) for batch in batches for i, tags in zip(batch["id"].tolist(), batch["tags"])}
        assert rows == dict(enumerate(expected))
        first = next(batch for batch in batches if batch["id"][0] < 4)  # the uniform row group: one length → 2-D
        assert first["tags"].shape == (4, 2) and first["tags"].dtype == object
    with RowGroupReader(tmp_path / "tags.parquet", batch_size=8, shuffle=True, shuffle_buffer_row_groups=2) as reader:
        (batch,) = list(reader)  # both row groups in one window: a ragged column of rows
    assert batch["tags"].shape == (8,) and {i: list(t) for i, t in zip(batch["id"], batch["tags"])} == dict(
        enumerate(expected))


def test_empty_files_and_empty_row_groups_leave_integer_columns_integer(tmp_path, caplog):
    """pandas and pyarrow write an empty file as one 0-row row group without statistics: it holds
    no NULL, so it must not turn the dataset's nullable integer columns into float64."""
    pq.write_table(pa.table({"id": pa.array([1, 2, 3], pa.int64())}), tmp_path / "a.parquet")
    pd.DataFrame({"id": pd.Series([], dtype="int64")}).to_parquet(tmp_path / "b_empty.parquet")
    with pq.ParquetWriter(tmp_path / "c_zero_row_groups.parquet", pa.schema([("id", pa.int64())])) as writer:
        for values in ([], [7, 8], []):
            writer.write_table(pa.table({"id": pa.array(values, pa.int64())}))
    for cache in (None, CacheConfig(tmp_path / "cache", 1 << 30)):
        with caplog.at_level("WARNING"), RowGroupReader(tmp_path, batch_size=8, shuffle=False, cache=cache) as reader:
            (batch,) = list(reader)
        assert batch["id"].dtype == np.int64 and batch["id"].tolist() == [1, 2, 3, 7, 8]
    assert "no null counts" not in caplog.text


def test_a_column_name_with_a_dot_keeps_its_footer_statistics(tmp_path):
    """Footer statistics were keyed by the leaf path's first dotted part ("score" for "score.v1"),
    so a NULL in a later row group did not widen the column: int batches, then float ones."""
    from training_core.data.parquet_files import index_dataset

    values = list(range(8))
    values[6] = None  # in the second row group
    table = pa.table({"score.v1": pa.array(values, pa.int64()), "tok.id": pa.array(range(100, 108), pa.int32())})
    pq.write_table(table, tmp_path / "dotted.parquet", row_group_size=4)
    with RowGroupReader(tmp_path / "dotted.parquet", batch_size=4, shuffle=False,
                        shuffle_buffer_row_groups=1) as reader:
        batches = list(reader)
    assert [batch["score.v1"].dtype for batch in batches] == [np.dtype(np.float64)] * 2
    assert batches[0]["score.v1"].tolist() == [0.0, 1.0, 2.0, 3.0] and np.isnan(batches[1]["score.v1"][2])
    assert [batch["tok.id"].dtype for batch in batches] == [np.dtype(np.int32)] * 2
    ranges = [ref.value_ranges for ref in index_dataset(tmp_path / "dotted.parquet").row_groups]
    assert [r["tok.id"] for r in ranges] == [(100, 103), (104, 107)]


def test_a_file_without_statistics_gives_a_nullable_column_one_dtype_in_every_batch(tmp_path, caplog):
    """Without footer null counts a NULL can only be found by decoding; the row groups before it
    must not come out as int while later ones are float. Required columns cannot hold one."""
    values = list(range(400))
    values[398] = None
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("x", pa.int32())])
    table = pa.table({"id": range(400), "x": values}, schema=schema)
    pq.write_table(table, tmp_path / "no-stats.parquet", row_group_size=4, write_statistics=False)
    for cache in (None, CacheConfig(tmp_path / "cache", 1 << 30), CacheConfig(tmp_path / "cache", 1 << 30)):
        with caplog.at_level("WARNING"), RowGroupReader(tmp_path / "no-stats.parquet", batch_size=4, shuffle=False,
                                                        cache=cache) as reader:
            batches = list(reader)
        assert "no-stats.parquet: no null counts in the Parquet footer for optional column(s) x: read as float64" \
            in caplog.text
        assert {batch["x"].dtype for batch in batches} == {np.dtype(np.float64)}
        assert {batch["id"].dtype for batch in batches} == {np.dtype(np.int64)}  # written as required: never null
        assert np.isnan(batches[-1]["x"][2]) and batches[0]["x"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_cached_row_groups_follow_the_dtype_of_the_dataset_they_are_read_in(tmp_path):
    """The same row group decodes as int alone and as float next to a file with NULLs: a cache
    shared by both datasets serves each its own form."""
    table = pa.table({"id": pa.array(range(100), pa.int64()), "x": pa.array(range(100), pa.int32())})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=10)
    nulls = pa.table({"id": pa.array(range(100, 110), pa.int64()), "x": pa.array([None] * 10, pa.int32())})
    pq.write_table(nulls, tmp_path / "b.parquet")
    cache = CacheConfig(tmp_path / "cache", 1 << 30)

    def dtypes(source) -> set[np.dtype]:
        with RowGroupReader(source, batch_size=10, shuffle=False, cache=cache) as reader:
            return {batch["x"].dtype for batch in reader}

    assert dtypes(tmp_path / "a.parquet") == {np.dtype(np.int32)}
    assert dtypes([tmp_path / "a.parquet", tmp_path / "b.parquet"]) == {np.dtype(np.float64)}
    assert dtypes(tmp_path / "a.parquet") == {np.dtype(np.int32)}


def test_interop_pandas_pyarrow_compression_and_side_files(tmp_path):
    root = tmp_path / "mixed"
    (root / "nested").mkdir(parents=True)
    frame = pd.DataFrame({"id": np.arange(0, 300), "text": [f"row {i}" for i in range(300)]})
    frame.index = frame.index + 1000  # a non-default index is stored as __index_level_0__
    frame.to_parquet(root / "a_pandas.parquet", engine="pyarrow", compression="gzip", row_group_size=70)
    for name, codec, rows in [("b_zstd", "zstd", range(300, 500)), ("c_snappy", "snappy", range(500, 900))]:
        table = pa.table({"id": pa.array(list(rows), pa.int64()), "text": [f"row {i}" for i in rows]})
        pq.write_table(table, root / "nested" / f"{name}.parquet", compression=codec, row_group_size=33)
    (root / "_SUCCESS").write_text("")
    (root / ".part.crc").write_bytes(b"\x00")
    (root / "nested" / "c_snappy.parquet.crc").write_bytes(b"\x00")
    (root / ".hidden.parquet").write_bytes(b"not parquet")
    (root / "_temporary").mkdir()
    (root / "_temporary" / "x.parquet").write_bytes(b"partial")
    with RowGroupReader(root, batch_size=128, seed=2, workers=3) as reader:
        assert reader.columns == ("id", "text")
        batches = list(reader)
    ids = np.concatenate([b["id"] for b in batches])
    texts = np.concatenate([b["text"] for b in batches])
    assert sorted(ids.tolist()) == list(range(900))
    assert all(text == f"row {i}" for i, text in zip(ids, texts))


def test_interop_duckdb_files_in_a_spark_style_folder_with_nulls_and_ragged_lists(tmp_path):
    """DuckDB's own Parquet writer (not Arrow's), its 2 048-row groups, zstd and gzip, NULL ints,
    strings and lists, ragged lists; Spark's side files around the parts. Read cold into a cache
    and again warm, every row matches what DuckDB itself returns."""
    import duckdb

    root = tmp_path / "spark-style"
    root.mkdir()
    query = """SELECT i::BIGINT AS id,
                      CASE WHEN i % 7 = 3 THEN NULL ELSE (i * 2)::INTEGER END AS score,
                      CASE WHEN i % 5 = 0 THEN NULL ELSE 'row ' || i END AS text,
                      CASE WHEN i % 11 = 0 THEN NULL
                           ELSE list_transform(range(i % 4), lambda x: (x + i)::INTEGER) END AS tokens
               FROM range({start}, {stop}) t(i)"""
    connection = duckdb.connect()
    for part, (start, stop, codec) in enumerate([(0, 5000, "zstd"), (5000, 8000, "gzip")]):
        path = root / f"part-{part:05d}-1f0c.c000.{codec}.parquet"
        connection.execute(f"COPY ({query.format(start=start, stop=stop)}) TO '{path}' "
                           f"(FORMAT parquet, COMPRESSION {codec}, ROW_GROUP_SIZE 2048)")
        (root / f".{path.name}.crc").write_bytes(b"\x00")
    (root / "_SUCCESS").write_text("")
    expected = {row[0]: row[1:] for row in connection.execute(query.format(start=0, stop=8000)).fetchall()}
    assert pq.ParquetFile(root / "part-00000-1f0c.c000.zstd.parquet").metadata.created_by.startswith("DuckDB")

    cache = CacheConfig(tmp_path / "cache", 1 << 30)
    for expect_hits in (False, True):
        with RowGroupReader(root, batch_size=500, seed=5, workers=2, cache=cache) as reader:
            assert reader.columns == ("id", "score", "text", "tokens")
            batches = list(reader)
            stats = reader.stats
        assert (stats.cache_hits > 0) == expect_hits and stats.cache_misses == (0 if expect_hits else 5)  # 3 + 2 row groups
        ids = np.concatenate([batch["id"] for batch in batches])
        assert sorted(ids.tolist()) == list(range(8000))
        for batch in batches:
            assert batch["score"].dtype == np.float64  # NULLs in an int column: float with NaN
            for row, row_id in enumerate(batch["id"].tolist()):
                score, text, tokens = expected[row_id]
                assert (np.isnan(batch["score"][row]) if score is None else batch["score"][row] == score)
                assert batch["text"][row] == text  # NULL string -> None
                assert batch["tokens"][row].tolist() == (tokens or [])  # NULL list -> empty


def test_list_of_sources_and_fsspec_uri(tmp_path):
    import fsspec

    first = write_ids_dataset(tmp_path / "one", [(40, 16)])
    second = write_ids_dataset(tmp_path / "two", [(40, 16)])
    ids = read_ids([first / "part-000.parquet", second], batch_size=16, shuffle=False)
    assert [len(b) for b in ids] == [16] * 5
    memory = fsspec.filesystem("memory")
    memory.pipe("/tess/data.parquet", (first / "part-000.parquet").read_bytes())
    try:
        batches = read_ids("memory://tess", batch_size=8, shuffle=False)
    finally:
        memory.rm("/tess", recursive=True)
    assert np.concatenate(batches).tolist() == list(range(40))


def test_bad_sources_raise_actionable_errors(tmp_path):
    with pytest.raises(SourceError, match="no such file"):
        RowGroupReader(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no Parquet files"):
        RowGroupReader(tmp_path / "empty")
    path = write_ids_dataset(tmp_path / "d", [(10, 5)])
    with pytest.raises(SourceError, match="missing column"):
        RowGroupReader(path, columns=["id", "nope"])


@pytest.mark.parametrize("statistics", [True, False])
def test_integers_beyond_2_to_the_53_widen_to_the_nearest_float(tmp_path, statistics):
    """Ints with nulls widen to float64 by contract, which is lossy beyond ±2**53: a safe cast refused
    those values and failed the read mid-epoch. Without nulls (and with statistics) they stay exact."""
    for name, values in [("clean", [BIG + i for i in range(4)]), ("nulls", [BIG, None, 5, BIG + 3])]:
        (tmp_path / name).mkdir()
        pq.write_table(pa.table({"row": pa.array(range(4), pa.int64()), "event_ns": pa.array(values, pa.int64())}),
                       tmp_path / name / "a.parquet", write_statistics=statistics)
    pq.write_table(pa.table({"row": pa.array(range(4, 6), pa.int64()), "event_ns": pa.array([BIG, BIG], pa.int64())}),
                   tmp_path / "nulls" / "b.parquet", write_statistics=statistics)  # no null here, one in a.parquet
    for cache in (None, CacheConfig(tmp_path / "cache", 1 << 26)):
        with RowGroupReader(tmp_path / "clean", batch_size=8, shuffle=False, cache=cache) as reader:
            clean = next(iter(reader))["event_ns"]
        if statistics:
            assert clean.dtype == np.int64 and clean.tolist() == [BIG + i for i in range(4)]
        else:  # no null counts: read as float64, like a column that holds nulls
            assert clean.dtype == np.float64 and clean.tolist() == [float(BIG + i) for i in range(4)]
        with RowGroupReader(tmp_path / "nulls", batch_size=8, shuffle=False, cache=cache) as reader:
            widened = next(iter(reader))["event_ns"]
        assert widened.dtype == np.float64
        assert widened[[0, 2, 3, 4, 5]].tolist() == [float(BIG), 5.0, float(BIG + 3), float(BIG), float(BIG)]
        assert np.isnan(widened[1])


def test_a_column_that_cannot_be_converted_is_named(tmp_path, monkeypatch):
    import training_core.data.arrow_numpy as arrow_numpy
    import training_core.data.parquet_files as parquet_files

    pq.write_table(pa.table({"id": [1, 2], "x": [3, 4]}), tmp_path / "a.parquet")
    real = arrow_numpy.arrow_to_numpy

    def failing(array, widen_nulls=False):
        if array.to_pylist() == [3, 4]:
            raise pa.ArrowInvalid("simulated conversion failure")
        return real(array, widen_nulls)

    monkeypatch.setattr(arrow_numpy, "arrow_to_numpy", failing)
    with RowGroupReader(tmp_path / "a.parquet", workers=1) as reader:
        with pytest.raises(parquet_files.RowGroupReadError,
                           match=r"a\.parquet row group 0: column 'x' \(int64\) cannot be converted to NumPy: "
                                 r"ArrowInvalid: simulated conversion failure"):
            next(iter(reader))


@pytest.mark.parametrize("new_first", [False, True])
def test_all_columns_of_files_with_different_columns_are_refused_in_either_sort_order(tmp_path, new_first):
    """columns=None took the first file's columns: a column added in later files was silently
    dropped, and in the other sort order the same files failed as "missing column"."""
    old_day, new_day = ("2026-01-02", "2026-01-01") if new_first else ("2026-01-01", "2026-01-02")
    for day in (old_day, new_day):
        (tmp_path / day).mkdir()
    pq.write_table(pa.table({"id": [1, 2]}), tmp_path / old_day / "part.parquet")
    pq.write_table(pa.table({"id": [3], "weight": [0.5]}), tmp_path / new_day / "part.parquet")
    with pytest.raises(SourceError) as info:
        RowGroupReader(tmp_path)
    message = str(info.value)
    assert f"'weight' is in {tmp_path / new_day / 'part.parquet'} but not in {tmp_path / old_day / 'part.parquet'}" \
        in message
    assert "pass columns=[...]" in message and "every file has ['id']" in message
    with RowGroupReader(tmp_path, columns=["id"], shuffle=False) as reader:
        assert sorted(np.concatenate([batch["id"] for batch in reader]).tolist()) == [1, 2, 3]


def test_a_local_source_path_starting_with_a_tilde_is_expanded(tmp_path, monkeypatch):
    import fsspec

    monkeypatch.setenv("HOME", str(tmp_path))
    write_ids_dataset(tmp_path / "data", [(30, 10), (20, 10)])
    assert sorted(np.concatenate(read_ids("~/data")).tolist()) == list(range(50))
    assert sorted(np.concatenate(read_ids(["~/data/part-001.parquet"])).tolist()) == list(range(30, 50))
    memory = fsspec.filesystem("memory")  # a URI's path belongs to its store: never expanded
    memory.pipe("/~/tilde/a.parquet", (tmp_path / "data" / "part-000.parquet").read_bytes())
    try:
        with RowGroupReader("memory://~/tilde") as reader:
            assert reader.dataset.files[0].path == "/~/tilde/a.parquet"
    finally:
        memory.rm("/~", recursive=True)


def test_linked_folders_are_read_once_and_a_link_to_a_file_that_is_gone_is_refused_by_name(tmp_path):
    """pyarrow's local listing leaves a dangling link out (the file it stood for would go unread) and
    walks a folder loop until the OS refuses the path (each file read ~40 times)."""
    import os
    import re

    store = write_ids_dataset(tmp_path / "store", [(30, 10), (20, 10)])
    data = tmp_path / "data"
    (data / "region").mkdir(parents=True)
    (data / "a.parquet").symlink_to(store / "part-000.parquet")
    (data / "region" / "linked").symlink_to(store, target_is_directory=True)  # folder links are followed
    (data / "region" / "linked-again").symlink_to(store, target_is_directory=True)  # ... once
    (store / "loop").symlink_to(data, target_is_directory=True)  # a link to an ancestor: read once
    (data / "_SUCCESS").symlink_to(tmp_path / "gone-marker")  # a side file: ignored, gone or not
    with RowGroupReader(data) as reader:
        assert [file.path for file in reader.dataset.files] == [
            str(data / "a.parquet"), str(data / "region" / "linked" / "part-000.parquet"),
            str(data / "region" / "linked" / "part-001.parquet")]
    assert sorted(np.concatenate(read_ids(data)).tolist()) == sorted([*range(30), *range(50)])

    (data / "region" / "b.parquet").symlink_to(store / "gone.parquet")
    link = data / "region" / "b.parquet"
    named = (f"{link}: a link to {store / 'gone.parquet'}, which leads to no file (its target is gone, or links loop); "
             "restore the target or remove the link")
    with pytest.raises(SourceError, match=f"^{re.escape(named)}$"):
        RowGroupReader(data)
    with pytest.raises(SourceError, match=f"^{re.escape(named)}$"):  # named on its own in a list of sources
        RowGroupReader([store / "part-001.parquet", link])
    os.remove(link)
    (data / "loop.parquet").symlink_to(data / "loop.parquet")
    with pytest.raises(SourceError, match=re.escape(f"{data / 'loop.parquet'}: a link to {data / 'loop.parquet'}, "
                                                    "which leads to no file")):
        RowGroupReader(data)
