"""Row-group cache: payload format, checksums, keys vs rewritten files, narrowing, warming, the
background writer and pooled reads. Quota, policies and store transactions: test_cache_quota.py."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training_core.data import CacheConfig, CacheWarmReport, RowGroupReader, cache_version, warm_cache
from training_core.data.cache import BufferPool, RowGroupCache
from training_core.data.cache_payload import (
    CorruptEntryError,
    decode_payload,
    decode_payload_views,
    encode_payload,
)
from training_core.data.cache_writer import CacheWriter

from .conftest import entry, write_ids_dataset


def sample_columns() -> dict[str, np.ndarray]:
    ragged = np.empty(3, dtype=object)
    ragged[:] = [np.arange(2, dtype=np.int16), np.arange(0, dtype=np.int16), np.arange(5, dtype=np.int16)]
    mixed = np.empty(3, dtype=object)
    mixed[:] = [None, "x", 1]
    return {
        "ids": np.arange(3, dtype=np.int64),
        "tokens": np.arange(12, dtype=np.int32).reshape(3, 4),
        "score": np.array([0.5, np.nan, 2.0]),
        "text": np.array(["a", "", "ünï"], dtype=object),
        "ragged": ragged,
        "mixed": mixed,
    }


def test_payload_round_trip_keeps_values_dtypes_and_shapes():
    columns = sample_columns()
    decoded = decode_payload(encode_payload(columns))
    assert list(decoded) == list(columns)
    for name in ("ids", "tokens", "score"):
        assert decoded[name].dtype == columns[name].dtype and decoded[name].shape == columns[name].shape
        np.testing.assert_array_equal(decoded[name], columns[name])
    assert list(decoded["text"]) == ["a", "", "ünï"]
    assert [r.tolist() for r in decoded["ragged"]] == [[0, 1], [], [0, 1, 2, 3, 4]]
    assert decoded["ragged"][0].dtype == np.int16
    assert list(decoded["mixed"]) == [None, "x", 1]


def test_integers_are_stored_narrow_and_read_back_in_their_logical_dtype():
    tokens = np.random.default_rng(0).integers(0, 32_000, (500, 64), dtype=np.int32)
    columns = {"tokens": tokens, "neg": np.array([-3, 100], dtype=np.int64), "big": np.array([0, 2**40])}
    payload = encode_payload(columns)
    assert len(payload) < tokens.nbytes * 0.55  # 2 bytes per token instead of 4
    views, logical = decode_payload_views(payload)
    assert views["tokens"].dtype == np.uint16 and logical["tokens"] == np.int32
    assert views["neg"].dtype == np.int8 and views["big"].dtype == np.int64
    decoded = decode_payload(payload)
    assert decoded["tokens"].dtype == np.int32 and np.array_equal(decoded["tokens"], tokens)
    assert decoded["neg"].tolist() == [-3, 100] and decoded["big"].tolist() == [0, 2**40]


def test_a_cache_folder_that_is_empty_or_a_file_is_refused_by_name(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="CacheConfig.directory is empty"):
        CacheConfig("", 1 << 20)
    with pytest.raises(ValueError, match=f"CacheConfig.directory {tmp_path / 'afile'} is a file, not a folder"):
        CacheConfig(tmp_path / "afile", 1 << 20)


def test_time_columns_are_cached_and_read_back_unchanged(tmp_path):
    """datetime64 / timedelta64 buffers cannot go through a memoryview as they are; before, every
    store of a dataset with a timestamp column failed and the cache never filled."""
    import datetime

    moments = [datetime.datetime(2026, 12, 5, hour) for hour in range(7)] + [None]
    table = pa.table({
        "id": pa.array(range(8), pa.int64()),
        "at": pa.array(moments, pa.timestamp("us")),
        "day": pa.array([datetime.date(2026, 12, 1 + i) for i in range(8)], pa.date32()),
        "took": pa.array([datetime.timedelta(seconds=i) for i in range(8)], pa.duration("ms")),
    })
    pq.write_table(table, tmp_path / "events.parquet", row_group_size=4)
    cache = CacheConfig(tmp_path / "cache", 1 << 30)
    reads = []
    for _ in range(2):
        with RowGroupReader(tmp_path / "events.parquet", batch_size=8, shuffle=False, cache=cache) as reader:
            (batch,) = list(reader)
            reads.append((batch, reader.stats.cache_hits))
    (cold, cold_hits), (warm, warm_hits) = reads
    assert (cold_hits, warm_hits) == (0, 2)
    assert warm["at"].dtype == np.dtype("datetime64[us]") and np.isnat(warm["at"][7])
    assert warm["day"].dtype == np.dtype("datetime64[D]") and warm["took"].dtype == np.dtype("timedelta64[ms]")
    for name in ("at", "day", "took"):
        np.testing.assert_array_equal(warm[name], cold[name])
    assert warm["at"][3] == np.datetime64("2026-12-05T03:00")


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "magic"])
def test_damaged_payload_is_detected(damage):
    payload = bytearray(encode_payload(sample_columns()))
    if damage == "flip":
        payload[len(payload) // 2] ^= 0xFF
    elif damage == "truncate":
        payload = payload[: len(payload) - 10]
    elif damage == "empty":
        payload = bytearray()
    else:
        payload[:4] = b"XXXX"
    with pytest.raises(CorruptEntryError):
        decode_payload(bytes(payload))


def test_rewritten_file_never_serves_stale_rows(tmp_path):
    path = tmp_path / "data.parquet"
    cache = CacheConfig(tmp_path / "cache", 2**26, shards=1)
    pq.write_table(pa.table({"v": np.arange(10)}), path, row_group_size=5)
    with RowGroupReader(path, batch_size=10, shuffle=False, cache=cache) as reader:
        assert next(iter(reader))["v"].tolist() == list(range(10))
    pq.write_table(pa.table({"v": np.arange(100, 110)}), path, row_group_size=5)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a rewrite within the mtime tick
    with RowGroupReader(path, batch_size=10, shuffle=False, cache=cache) as reader:
        assert next(iter(reader))["v"].tolist() == list(range(100, 110))
        assert reader.stats.cache_hits == 0


def _two_parquet_files_of_one_size() -> tuple[bytes, bytes]:
    """Parquet bytes of rows 10..19, and of other rows in a file of exactly the same size."""
    import io

    def parquet_bytes(values) -> bytes:
        sink = io.BytesIO()
        pq.write_table(pa.table({"v": np.asarray(values, dtype=np.int64)}), sink, row_group_size=5)
        return sink.getvalue()

    first = parquet_bytes(range(10, 20))
    return first, next(data for k in range(1, 1000)
                       if len(data := parquet_bytes(range(1000 * k, 1000 * k + 10))) == len(first))


def test_a_local_file_rewritten_with_the_same_size_never_serves_stale_rows(tmp_path):
    # path and size match the cached entries: only the modification time tells the rewrite apart
    import io

    first, second = _two_parquet_files_of_one_size()
    path = tmp_path / "data.parquet"
    cache = CacheConfig(tmp_path / "cache", 2**26, shards=1)
    path.write_bytes(first)
    with RowGroupReader(path, batch_size=10, shuffle=False, cache=cache) as reader:
        assert next(iter(reader))["v"].tolist() == list(range(10, 20))
        first_mtime = reader.dataset.files[0].mtime_ns
    path.write_bytes(second)
    os.utime(path, ns=(first_mtime + 10**9, first_mtime + 10**9))  # a later mtime even on a coarse clock
    expected = pq.read_table(io.BytesIO(second))["v"].to_pylist()
    with RowGroupReader(path, batch_size=10, shuffle=False, cache=cache) as reader:
        assert reader.dataset.files[0].size == len(first)
        assert next(iter(reader))["v"].tolist() == expected
        assert reader.stats.cache_hits == 0


def test_a_file_rewritten_with_the_same_size_on_a_filesystem_without_mtimes_never_serves_stale_rows(tmp_path):
    # fsspec's memory:// (and backends that name the time otherwise) report no mtime: the identity
    # falls back to the footer's digest, so a same-size rewrite still misses the cache.
    import io

    import fsspec

    first, second = _two_parquet_files_of_one_size()
    memory = fsspec.filesystem("memory")
    source = f"memory://{tmp_path.name}/part.parquet"
    cache = CacheConfig(tmp_path / "cache", 2**26, shards=1)
    try:
        memory.pipe(f"/{tmp_path.name}/part.parquet", first)
        with RowGroupReader(source, batch_size=10, shuffle=False, cache=cache, workers=1) as reader:
            assert next(iter(reader))["v"].tolist() == list(range(10, 20))
            assert reader.dataset.files[0].mtime_ns is None  # what makes this case
        memory.pipe(f"/{tmp_path.name}/part.parquet", second)  # same path, same size
        with RowGroupReader(source, batch_size=10, shuffle=False, cache=cache, workers=1) as reader:
            assert next(iter(reader))["v"].tolist() == [int(v) for v in pq.read_table(io.BytesIO(second))["v"]]
            assert reader.stats.cache_hits == 0
        with RowGroupReader(source, batch_size=10, shuffle=False, cache=cache, workers=1) as reader:
            next(iter(reader))
            assert reader.stats.cache_hits == 2  # an unchanged file still hits
    finally:
        memory.rm(f"/{tmp_path.name}", recursive=True)


def _integer_table(rows: int, shift: int) -> pa.Table:
    rng = np.random.default_rng(shift)
    tokens = rng.integers(0, 32_000, (rows, 8), dtype=np.int32)
    return pa.table({
        "small": pa.array(np.arange(rows) % 200 + shift, pa.int64()),
        "signed": pa.array(np.arange(rows) - rows // 2 - shift, pa.int32()),
        "big": pa.array(np.arange(rows) * 2**33 + shift, pa.int64()),
        "unsigned": pa.array(np.arange(rows, dtype=np.uint32) + np.uint32(4_000_000_000 - shift), pa.uint32()),
        "u16": pa.array((np.arange(rows) * 331 + shift) % 65_536, pa.uint16()),
        "tokens": pa.FixedSizeListArray.from_arrays(tokens.ravel(), 8).cast(pa.list_(pa.int32())),
        "score": pa.array(np.linspace(0, 1, rows)),
    })


@pytest.mark.parametrize("statistics", [True, False])
def test_statistics_narrowing_picks_the_dtype_a_scan_picks(tmp_path, statistics):
    from training_core.data.cache_payload import narrow_dtype
    from training_core.data.arrow_numpy import table_to_numpy
    from training_core.data.parquet_files import index_dataset, read_row_group_table

    table = pa.concat_tables([_integer_table(300, shift) for shift in (0, 7, 300)])
    pq.write_table(table, tmp_path / "ints.parquet", row_group_size=300, write_statistics=statistics)
    index = index_dataset(tmp_path / "ints.parquet")
    integer_columns = {"small", "signed", "big", "unsigned", "u16", "tokens"}
    for ref in index.row_groups:
        ranges = ref.value_ranges
        assert set(ranges) == (integer_columns if statistics else set()), "statistics are used only when present"
        arrays = table_to_numpy(read_row_group_table(index.filesystem, ref, index.columns, {}))
        for name, array in arrays.items():
            assert narrow_dtype(array, ranges.get(name)) == narrow_dtype(array), (ref.index, name)
        views, logical = decode_payload_views(encode_payload(arrays, ranges))
        assert {name: view.dtype for name, view in views.items()} == {
            name: narrow_dtype(array) for name, array in arrays.items()}
        for name, array in arrays.items():
            np.testing.assert_array_equal(views[name].astype(logical[name]), array)
    assert narrow_dtype(arrays["tokens"]) == np.uint16 and narrow_dtype(arrays["signed"]) == np.int16
    assert narrow_dtype(arrays["big"]) == np.int64 and narrow_dtype(arrays["unsigned"]) == np.uint32


def test_statistics_are_not_used_for_transformed_columns(tmp_path):
    data = write_ids_dataset(tmp_path / "d", [(300, 100)])
    config = CacheConfig(tmp_path / "c", 2**26, shards=2)

    def shift(arrays):  # values far outside the file's statistics
        return {**arrays, "tokens": arrays["tokens"] + 1_000_000}

    def read(cache):
        with RowGroupReader(data, batch_size=300, shuffle=False, cache=cache, transform=shift,
                            transform_version="shift") as reader:
            return next(iter(reader)), reader.stats

    cold, cold_stats = read(config)
    warm, warm_stats = read(config)
    assert cold_stats.cache_misses == 3 and warm_stats.cache_hits == 3
    assert warm["tokens"].min() >= 1_000_000
    np.testing.assert_array_equal(warm["tokens"], cold["tokens"])
    np.testing.assert_array_equal(warm["id"], cold["id"])


def test_a_file_rewritten_after_listing_is_not_narrowed_with_the_listings_statistics(tmp_path):
    """The listing's footer said 0..99 (uint8); the file decoded holds 1000..1099. Narrowing with
    the stale range wrapped the values silently (232, 233, …) and stored them in the cache."""
    path = tmp_path / "a.parquet"
    schema = pa.schema([pa.field("tok", pa.int32(), nullable=False)])
    pq.write_table(pa.table({"tok": np.arange(100, dtype=np.int32)}, schema=schema), path)
    for write_queue_bytes in (0, 1 << 20):  # stored on the decode thread / by the background writer
        config = CacheConfig(tmp_path / f"c{write_queue_bytes}", 2**26, shards=1, write_queue_bytes=write_queue_bytes)
        with RowGroupReader(path, batch_size=100, shuffle=False, cache=config) as reader:
            pq.write_table(pa.table({"tok": np.arange(1000, 1100, dtype=np.int32)}, schema=schema), path)
            (cold,) = list(reader)
            (warm,) = list(reader)  # the entry stored under the listed identity holds what was served
            assert reader.stats.cache_hits == 1
        assert cold["tok"].tolist() == warm["tok"].tolist() == list(range(1000, 1100))
        pq.write_table(pa.table({"tok": np.arange(100, dtype=np.int32)}, schema=schema), path)


def test_warm_cache_reports_and_versions(tmp_path):
    data = write_ids_dataset(tmp_path / "d", [(300, 64)])
    config = CacheConfig(tmp_path / "c", 2**26, shards=2)
    first = warm_cache(data, config, columns=["id"], dataset_digest="abc")
    assert isinstance(first, CacheWarmReport)
    assert first.entries == 5 and first.misses == 5 and first.hits == 0 and first.bytes > 0
    assert first.cache_version == cache_version("abc", ["id"], "none")
    second = warm_cache(data, config, columns=["id"], dataset_digest="abc")
    assert second.hits == 5 and second.hit_rate == 1.0
    assert len(first.cache_version) == 16 and int(first.cache_version, 16) >= 0
    assert cache_version("abc", ["id"], "none") != cache_version("abd", ["id"], "none")
    assert cache_version("abc", ["id"], "none") != cache_version("abc", ["id", "tokens"], "none")
    assert cache_version("abc", ["id"], "none") != cache_version("abc", ["id"], "v2")
    with RowGroupReader(data, columns=["id"], cache=config) as reader:
        assert sum(len(b["id"]) for b in reader) == 300
        assert reader.stats.cache_hits == 5 and reader.stats.cache_misses == 0


def test_warm_report_counts_this_datasets_entries_in_a_shared_cache(tmp_path):
    first = write_ids_dataset(tmp_path / "a", [(300, 64)])
    second = write_ids_dataset(tmp_path / "b", [(200, 64)])
    config = CacheConfig(tmp_path / "c", 2**26, shards=2)
    alone = warm_cache(second, CacheConfig(tmp_path / "alone", 2**26, shards=2), columns=["id"])
    warm_cache(first, config, columns=["id"])
    shared = warm_cache(second, config, columns=["id"])
    assert (shared.entries, shared.bytes) == (alone.entries, alone.bytes) == (4, alone.bytes)
    assert shared.bytes > 0


def test_warming_removes_value_files_a_killed_writer_left_without_an_entry(tmp_path):
    data = write_ids_dataset(tmp_path / "d", [(300, 64)])
    config = CacheConfig(tmp_path / "c", 2**26, shards=2)
    assert warm_cache(data, config, columns=["id"]).orphan_files_removed == 0
    values = sorted((tmp_path / "c").rglob("*.val"))
    assert len(values) == 5
    old_orphan = values[0].with_name("0123456789abcdef0123456789abcdef.val")
    fresh_orphan = values[0].with_name("fedcba9876543210fedcba9876543210.val")  # a writer's open transaction
    old_orphan.write_bytes(b"partial entry")
    fresh_orphan.write_bytes(b"being written")
    os.utime(old_orphan, (time.time() - 3600, time.time() - 3600))
    report = warm_cache(data, config, columns=["id"])
    assert report.orphan_files_removed == 1 and report.hits == 5
    assert not old_orphan.exists() and fresh_orphan.exists()
    assert all(path.exists() for path in values)


def test_warm_cache_closes_its_cache_when_a_row_group_fails(tmp_path, monkeypatch):
    from training_core.data import workers
    from training_core.data.parquet_files import RowGroupReadError

    data = write_ids_dataset(tmp_path / "d", [(300, 64)])
    closed = []
    monkeypatch.setattr(workers.RowGroupCache, "close", lambda self: closed.append(self))

    def fail(self, ref, **kwargs):
        raise RowGroupReadError(f"{ref.describe()}: unreadable")

    monkeypatch.setattr(workers.RowGroupLoader, "load", fail)
    with pytest.raises(RowGroupReadError, match="unreadable"):
        warm_cache(data, CacheConfig(tmp_path / "c", 2**26), columns=["id"])
    assert len(closed) == 1


class _GatedCache(RowGroupCache):
    """A cache whose stores wait for ``gate`` (a slow disk), announcing each one on ``entered``."""

    def __init__(self, config: CacheConfig) -> None:
        super().__init__(config)
        self.entered, self.gate = threading.Semaphore(0), threading.Event()

    def put_many(self, entries) -> list[bool]:
        self.entered.release()
        assert self.gate.wait(timeout=30)
        return super().put_many(entries)


def test_background_writer_stores_everything_queued_before_close(tmp_path):
    config = CacheConfig(tmp_path / "c", 2**26, shards=2)
    cache = RowGroupCache(config)
    writer = CacheWriter(cache, "tessera-reader-test", max_pending_bytes=2**26)
    for i in range(6):
        assert writer.submit(f"k{i}", entry(i))
    writer.close()
    assert not any(t.name == "tessera-reader-test-cache-writer" for t in threading.enumerate())
    assert len(cache) == 6 and cache.counters.dropped == 0
    assert cache.get("k5", "k5")[0]["x"][0, 0] == 5
    assert not writer.submit("late", entry(9)) and cache.counters.dropped == 1, "a closed writer stores nothing"
    cache.close()


def test_background_writer_drops_rather_than_blocks_when_full(tmp_path):
    cache = _GatedCache(CacheConfig(tmp_path / "c", 2**26, shards=1))
    one = sum(a.nbytes for a in entry(0).values())
    writer = CacheWriter(cache, "tessera-reader-test", max_pending_bytes=2 * one)
    assert writer.submit("k0", entry(0))
    assert cache.entered.acquire(timeout=30)  # the writer is now inside put("k0"), still pending
    assert writer.submit("k1", entry(1))  # two row groups' worth pending: full
    assert not writer.submit("k2", entry(2)) and not writer.submit("k3", entry(3))
    assert cache.counters.dropped == 2
    cache.gate.set()
    writer.close()
    assert len(cache) == 2 and cache.get("k1", "k1") is not None and cache.get("k2", "k2") is None
    cache.close()


def test_pooled_hits_read_into_reused_buffers_without_aliasing_ragged_rows(tmp_path):
    cache = RowGroupCache(CacheConfig(tmp_path / "c", 2**26, shards=1))
    columns = {**entry(3), "ragged": sample_columns()["ragged"]}
    cache.put("k", columns)
    buffers = BufferPool()
    views, logical, buffer = cache.get_pooled("k", "k", buffers)
    assert buffer is not None and np.shares_memory(views["x"], buffer)
    assert not any(np.shares_memory(row, buffer) for row in views["ragged"])
    ragged = [row.copy() for row in views["ragged"]]
    buffers.release(buffer)
    again = cache.get_pooled("k", "k", buffers)
    assert again[2] is buffer, "a released buffer is reused"
    buffer[:] = 0  # whatever overwrites the buffer later, the ragged rows handed out stay intact
    assert [r.tolist() for r in views["ragged"]] == [r.tolist() for r in ragged]
    cache.close()


def test_warm_rows_of_a_list_column_dense_in_one_row_group_and_ragged_in_another_are_not_aliased(tmp_path):
    # Even row groups hold lists of one length (cached as a dense 2-D block in a pooled read buffer),
    # odd ones ragged lists: a window mixing both turns the dense rows into object rows, which must
    # not stay views of the read buffer that the next cache hit overwrites.
    ids, lists = [], []
    for group in range(40):
        for j in range(50):
            ids.append(group * 50 + j)
            lists.append([float(ids[-1])] * (3 if group % 2 == 0 else 1 + j % 4))
    table = pa.table({"id": pa.array(ids, pa.int64()), "emb": pa.array(lists, pa.list_(pa.float32()))})
    pq.write_table(table, tmp_path / "mixed.parquet", row_group_size=50)
    config = CacheConfig(tmp_path / "cache", 2**28)
    for _ in ("cold", "warm"):
        with RowGroupReader(tmp_path / "mixed.parquet", batch_size=32, seed=1, shuffle_buffer_row_groups=2,
                            workers=2, cache=config) as reader:
            batches = list(reader)
        foreign = [int(i) for b in batches for i, row in zip(b["id"], b["emb"]) if not np.all(np.asarray(row) == i)]
        assert foreign == [], f"rows hold another row's values after the window was assembled: {foreign[:5]}"
    assert reader.stats.cache_hits == 40


def test_located_entries_fall_back_when_evicted_by_another_handle(tmp_path):
    config = CacheConfig(tmp_path / "c", 2**26, shards=2)
    cache, other = RowGroupCache(config), RowGroupCache(config)
    for i in range(3):
        cache.put(f"k{i}", entry(i))
    assert cache.locate(["k0", "k1", "k2", "absent"]) == 3
    other._cache.delete("k1")  # another process evicts k1 after we located it
    other.put("k2", entry(22))  # ... and rewrites k2 (new file, old one deleted)
    buffers = BufferPool()
    assert cache.get_pooled("k0", "k0", buffers)[0]["x"][0, 0] == 0
    assert cache.get_pooled("k1", "k1", buffers) is None
    assert cache.get_pooled("k2", "k2", buffers)[0]["x"][0, 0] == 22
    assert cache.counters.corruptions == 0 and cache.counters.misses == 1
    cache.close()
    other.close()


def test_stores_remember_value_files_and_forget_evicted_keys(tmp_path):
    """Entries stored through a handle are found like :meth:`RowGroupCache.locate` finds them (no
    re-scan after an epoch); evicted keys are forgotten; a stale path falls back to the lookup."""
    cache = RowGroupCache(CacheConfig(tmp_path / "c", 1_000_000, policy="evict", shards=1))
    for i in range(30):
        assert cache.put(f"k{i}", entry(i))
    assert cache.counters.evictions > 0
    remembered = dict(cache._files)
    assert "k29" in remembered and "k0" not in remembered
    assert all(os.path.exists(path) for path in remembered.values())
    assert len(remembered) == len(cache)
    assert cache.locate(list(remembered)) == len(remembered) and cache._files == remembered
    os.remove(remembered["k29"])  # a stale path: the normal lookup takes over (and sees the damage)
    buffers = BufferPool()
    assert cache.get_pooled("k28", "k28", buffers)[0]["x"][0, 0] == 28
    assert cache.get_pooled("k29", "k29", buffers) is None and "k29" not in cache._files
    cache.close()
