"""Failure paths of the row-group reader: errors keep their cause, nothing hangs, threads stop."""
from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem

from training_core.data import CacheConfig, RowGroupReader
from training_core.data.parquet_files import ReadTimeoutError, RowGroupReadError
from training_core.data.workers import TransformError


def write_dataset(directory: Path, rows: int = 400, row_group_size: int = 50) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    ids = np.arange(rows, dtype=np.int64)
    pq.write_table(pa.table({"id": ids, "x": ids.astype(np.float32)}), directory / "a.parquet",
                   row_group_size=row_group_size)
    return directory


def reader_threads(reader: RowGroupReader) -> list[str]:
    prefix = f"tessera-reader-{reader._id}-"
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


class _GatedFile:
    """File wrapper whose reads block on ``gate`` once ``armed`` is set (a hung object store)."""

    def __init__(self, inner, armed: threading.Event, gate: threading.Event) -> None:
        self._inner, self._armed, self._gate = inner, armed, gate

    def read(self, *args):
        if self._armed.is_set():
            self._gate.wait()  # released by the test, so the thread can finish
        return self._inner.read(*args)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._inner.close()


class HangingFileSystem(LocalFileSystem):
    def __init__(self, armed: threading.Event, gate: threading.Event, **kwargs) -> None:
        super().__init__(**kwargs)
        self.armed, self.gate = armed, gate

    def _open(self, path, mode="rb", **kwargs):
        return _GatedFile(super()._open(path, mode, **kwargs), self.armed, self.gate)


class FlakyFileSystem(LocalFileSystem):
    """Every open fails with OSError until ``failures`` opens have failed."""

    def __init__(self, failures: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.failures, self.calls = failures, 0

    def _open(self, path, mode="rb", **kwargs):
        self.calls += 1
        if self.calls > 1 and self.failures > 0:  # the first open reads the footer
            self.failures -= 1
            raise OSError(f"simulated transient failure opening {path}")
        return super()._open(path, mode, **kwargs)


def test_transform_error_surfaces_with_its_cause(tmp_path):
    data = write_dataset(tmp_path / "d")

    def broken(columns):
        if columns["id"][0] >= 200:
            raise ValueError("bad row in transform")
        return columns

    reader = RowGroupReader(data, batch_size=50, shuffle=False, shuffle_buffer_row_groups=1, transform=broken,
                            transform_version="broken")
    seen = []
    with pytest.raises(TransformError, match=r"a\.parquet row group 4: transform raised ValueError") as info:
        for batch in reader:
            seen.append(batch["id"])
    assert isinstance(info.value.__cause__, ValueError)
    assert np.concatenate(seen).tolist() == list(range(200))
    reader.close()
    assert reader_threads(reader) == []


def test_hanging_storage_raises_within_read_timeout(tmp_path):
    data = write_dataset(tmp_path / "d")
    armed, gate = threading.Event(), threading.Event()
    fs = HangingFileSystem(armed, gate)
    reader = RowGroupReader(str(data), filesystem=fs, batch_size=50, read_timeout_s=0.5, workers=2)
    armed.set()
    began = time.monotonic()
    try:
        with pytest.raises(ReadTimeoutError, match=r"row group \d+: no result after read_timeout_s=0.5s"):
            next(iter(reader))
        assert time.monotonic() - began < 3.0
    finally:
        gate.set()  # the hung reads return now; their daemon threads see the stop event and exit
        reader.close()
    for thread in threading.enumerate():
        if thread.name.startswith(f"tessera-reader-{reader._id}-"):
            thread.join(timeout=5.0)
    assert reader_threads(reader) == []


def test_transient_read_errors_are_retried(tmp_path):
    data = write_dataset(tmp_path / "d", rows=100, row_group_size=100)
    fs = FlakyFileSystem(failures=2)
    with RowGroupReader(str(data), filesystem=fs, batch_size=100, workers=1) as reader:
        assert sorted(next(iter(reader))["id"].tolist()) == list(range(100))
    assert fs.failures == 0


def test_retries_wait_with_growing_delays():
    # back-to-back retries would hit a struggling object store again at once; the waits double
    from training_core.data.parquet_files import retry_storage_errors

    attempts: list[float] = []

    def read() -> str:
        attempts.append(time.monotonic())
        if len(attempts) < 4:
            raise ConnectionResetError(104, "simulated connection reset")
        return "rows"

    assert retry_storage_errors(read, "a.parquet row group 0", max_attempts=4, backoff_s=0.05) == "rows"
    gaps = [later - earlier for earlier, later in zip(attempts, attempts[1:])]
    assert all(gap >= 0.99 * wait for gap, wait in zip(gaps, (0.05, 0.1, 0.2))), f"waits between attempts: {gaps}"


def test_a_transient_error_reading_a_footer_while_listing_is_retried(tmp_path):
    data = write_dataset(tmp_path / "d", rows=100, row_group_size=100)

    class FlakyFooterFileSystem(LocalFileSystem):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.failures = 2

        def _open(self, path, mode="rb", **kwargs):
            if self.failures > 0:  # the first opens are the listing's footer reads
                self.failures -= 1
                raise ConnectionResetError(104, f"simulated connection reset opening {path}")
            return super()._open(path, mode, **kwargs)

    fs = FlakyFooterFileSystem()
    with RowGroupReader(str(data), filesystem=fs, batch_size=100, workers=1) as reader:
        assert sorted(next(iter(reader))["id"].tolist()) == list(range(100))
    assert fs.failures == 0


def test_persistent_read_errors_name_the_row_group(tmp_path):
    data = write_dataset(tmp_path / "d", rows=100, row_group_size=100)
    fs = FlakyFileSystem(failures=100)
    with RowGroupReader(str(data), filesystem=fs, batch_size=100, workers=1) as reader:
        with pytest.raises(RowGroupReadError, match=r"a\.parquet row group 0: read failed after 3 attempt") as info:
            next(iter(reader))
    assert isinstance(info.value.__cause__, OSError)


def test_damaged_bytes_are_not_retried_but_a_dropped_connection_is(tmp_path, caplog):
    # pyarrow raises a page header that does not parse as OSError, like a storage error; the same
    # bytes decode no better on a second try, so the reader names it at once instead of retrying.
    from training_core.data.parquet_files import _is_damaged_data

    path = tmp_path / "damaged.parquet"
    pq.write_table(pa.table({"v": np.random.default_rng(0).integers(0, 2**40, 5000)}), path,
                   row_group_size=5000, compression="snappy", use_dictionary=False)
    raw = bytearray(path.read_bytes())
    for offset in range(4, 40):  # the first page header; the footer stays intact
        raw[offset] ^= 0x5A
    path.write_bytes(bytes(raw))
    with caplog.at_level("WARNING", logger="training_core.data"):
        with pytest.raises(RowGroupReadError, match=r"damaged\.parquet row group 0: cannot decode: .*thrift"):
            with RowGroupReader(path, batch_size=100, workers=1, read_timeout_s=30) as reader:
                next(iter(reader))
    assert "retry" not in caplog.text

    assert _is_damaged_data(OSError("Couldn't deserialize thrift: don't know what type"))
    assert _is_damaged_data(OSError("Parquet magic bytes not found in footer"))
    assert not _is_damaged_data(ConnectionResetError(104, "Connection reset by peer"))
    assert not _is_damaged_data(OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 28"))

def test_corrupted_cache_file_is_detected_counted_and_reread(tmp_path):
    data = write_dataset(tmp_path / "d", rows=4000, row_group_size=1000)
    cache = CacheConfig(tmp_path / "cache", 2**26, shards=1)
    with RowGroupReader(data, batch_size=4000, shuffle=False, cache=cache) as reader:
        expected = next(iter(reader))["id"].copy()
    values = sorted((tmp_path / "cache").rglob("*.val"))
    assert len(values) == 4
    with open(values[0], "r+b") as handle:
        handle.seek(200)
        handle.write(b"\xde\xad\xbe\xef")
    with open(values[1], "r+b") as handle:
        handle.truncate(100)
    with RowGroupReader(data, batch_size=4000, shuffle=False, cache=cache) as reader:
        assert np.array_equal(next(iter(reader))["id"], expected)
        stats = reader.stats
    assert stats.cache_corruptions == 2 and stats.cache_hits == 2 and stats.cache_misses == 2
    with RowGroupReader(data, batch_size=4000, shuffle=False, cache=cache) as reader:
        next(iter(reader))
        assert reader.stats.cache_hits == 4, "re-read entries are stored again"


def test_abandoned_iterator_stops_all_threads(tmp_path):
    data = write_dataset(tmp_path / "d", rows=4000, row_group_size=100)
    reader = RowGroupReader(data, batch_size=10, workers=4, prefetch_batches=2)
    iterator = iter(reader)
    next(iterator)
    assert len(reader_threads(reader)) == 5  # 4 decoders + 1 assembler
    del iterator
    gc.collect()
    assert reader_threads(reader) == []
    for batch in reader:  # the reader itself stays usable
        break
    reader.close()
    assert reader_threads(reader) == []


def test_abandoned_for_loop_and_context_manager_stop_threads(tmp_path):
    data = write_dataset(tmp_path / "d", rows=4000, row_group_size=100)
    with RowGroupReader(data, batch_size=10, workers=2) as reader:
        for _ in reader:
            break
        gc.collect()
        assert reader_threads(reader) == []
        iterator = iter(reader)
        next(iterator)
    assert reader_threads(reader) == []
    with pytest.raises(StopIteration):
        next(iterator)


def test_fsspec_memory_filesystem_instance(tmp_path):
    data = write_dataset(tmp_path / "d", rows=120, row_group_size=40)
    memory = fsspec.filesystem("memory")
    memory.pipe("/faults/a.parquet", (data / "a.parquet").read_bytes())
    try:
        with RowGroupReader("/faults", filesystem=memory, batch_size=40, seed=3) as reader:
            ids = np.concatenate([batch["id"] for batch in reader])
    finally:
        memory.rm("/faults", recursive=True)
    assert sorted(ids.tolist()) == list(range(120))


def test_cache_writer_thread_stops_with_the_iterator_and_flushes(tmp_path):
    data = write_dataset(tmp_path / "d", rows=4000, row_group_size=100)
    cache = CacheConfig(tmp_path / "cache", 2**26, shards=2)
    reader = RowGroupReader(data, batch_size=10, workers=2, prefetch_batches=2, cache=cache)
    iterator = iter(reader)
    next(iterator)
    assert f"tessera-reader-{reader._id}-cache-writer" in reader_threads(reader)
    del iterator  # abandoned mid-epoch: the writer stores what it was given, then exits
    gc.collect()
    assert reader_threads(reader) == []
    stored = reader.stats
    assert stored.cache_misses > 0 and stored.cache_dropped == 0
    with RowGroupReader(data, batch_size=10, workers=2, cache=cache) as again:
        next(iter(again))
        assert again.stats.cache_hits > 0, "what the abandoned reader decoded was stored"
    reader.close()
    assert reader_threads(reader) == []


def test_cold_pass_entries_are_all_present_after_close(tmp_path):
    data = write_dataset(tmp_path / "d", rows=4000, row_group_size=100)  # 40 row groups, ~1 MB: never dropped
    cache = CacheConfig(tmp_path / "cache", 2**26, shards=2)
    with RowGroupReader(data, batch_size=64, workers=4, cache=cache) as cold:
        expected = np.concatenate([batch["id"] for batch in cold])
        assert cold.stats.cache_misses == 40 and cold.stats.cache_dropped == 0
    assert reader_threads(cold) == []
    with RowGroupReader(data, batch_size=64, workers=3, cache=cache) as warm:
        assert np.array_equal(np.concatenate([batch["id"] for batch in warm]), expected)
        assert warm.stats.cache_hits == 40 and warm.stats.cache_misses == 0


def test_full_write_queue_drops_entries_counts_them_and_keeps_the_order(tmp_path):
    data = write_dataset(tmp_path / "d", rows=4000, row_group_size=100)
    tiny = CacheConfig(tmp_path / "cache", 2**26, shards=2, write_queue_bytes=1)  # at most one pending store
    reference = RowGroupReader(data, batch_size=64, seed=5)
    expected = np.concatenate([batch["id"] for batch in reference])
    reference.close()
    with RowGroupReader(data, batch_size=64, seed=5, cache=tiny) as cold:
        assert np.array_equal(np.concatenate([batch["id"] for batch in cold]), expected)
        stats = cold.stats
    assert stats.cache_misses == 40 and stats.cache_dropped < 40
    with RowGroupReader(data, batch_size=64, seed=5, cache=tiny) as warm:
        assert np.array_equal(np.concatenate([batch["id"] for batch in warm]), expected)
        assert warm.stats.cache_hits == 40 - stats.cache_dropped, "exactly the dropped entries are re-read"


class LatencyFileSystem(LocalFileSystem):
    """Every open costs ``latency_s`` (one request to a remote store) and is counted; opening a path
    that ends with ``hang_on`` blocks until ``gate`` is set (a request the store never answers)."""

    def __init__(self, latency_s: float, hang_on: str | None = None, gate: threading.Event | None = None) -> None:
        super().__init__(skip_instance_cache=True)
        self.latency_s, self.hang_on, self.gate = latency_s, hang_on, gate
        self.opens = 0

    def _open(self, path, mode="rb", **kwargs):
        self.opens += 1
        time.sleep(self.latency_s)
        if self.hang_on is not None and str(path).endswith(self.hang_on):
            self.gate.wait()  # released by the test, so the thread can finish
        return super()._open(path, mode, **kwargs)


def write_many_files(directory: Path, files: int) -> Path:
    directory.mkdir(parents=True)
    for i in range(files):
        pq.write_table(pa.table({"id": np.arange(i * 10, i * 10 + 10, dtype=np.int64)}),
                       directory / f"part-{i:04d}.parquet")
    return directory


def test_read_timeout_bounds_each_footer_read_not_the_whole_listing(tmp_path):
    """40 files at 20 ms a request take ~0.8 s to list, over read_timeout_s=0.3 s: one deadline for
    the listing and every footer meant such a dataset could never be opened."""
    from training_core.data import warm_cache

    data = write_many_files(tmp_path / "d", 40)
    fs = LatencyFileSystem(latency_s=0.02)
    began = time.monotonic()
    with RowGroupReader(str(data), filesystem=fs, batch_size=400, read_timeout_s=0.3, workers=2) as reader:
        assert time.monotonic() - began > 0.3, "the listing must outlast read_timeout_s for this test to mean anything"
        assert reader.num_rows == 400
        assert sorted(next(iter(reader))["id"].tolist()) == list(range(400))
    report = warm_cache(str(data), CacheConfig(tmp_path / "cache", 2**26), filesystem=fs, read_timeout_s=0.3)
    assert report.entries == 40


def test_a_hanging_footer_read_raises_within_read_timeout_and_stops_the_listing(tmp_path):
    data = write_many_files(tmp_path / "d", 12)
    gate = threading.Event()
    fs = LatencyFileSystem(latency_s=0.01, hang_on="part-0004.parquet", gate=gate)
    began = time.monotonic()
    try:
        with pytest.raises(ReadTimeoutError, match=r"footer of .*part-0004\.parquet: no result after "
                                                   r"read_timeout_s=0.3s"):
            RowGroupReader(str(data), filesystem=fs, read_timeout_s=0.3)
        assert time.monotonic() - began < 2.0
        opened = fs.opens
    finally:
        gate.set()  # the hung request returns now
    time.sleep(0.5)  # time for an abandoned listing to open the 7 files left (10 ms each)
    assert fs.opens == opened, "the abandoned listing went on opening files after the timeout"
    listing = [thread for thread in threading.enumerate()
               if thread.name.startswith("tessera-reader-") and thread.name.endswith("-index-decode-0")]
    for thread in listing:
        thread.join(timeout=5.0)
    assert not any(thread.is_alive() for thread in listing)
