"""A full disk under the row-group cache, on a real small tmpfs: warming fails naming the cache folder (not
the dataset's Parquet file), opening names the folder, training reads go on without storing."""
from __future__ import annotations

import errno
import logging
import sqlite3
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training_core.data import CacheConfig, RowGroupReader, warm_cache
from training_core.data.cache import CacheStorageError
from training_core.data.parquet_files import RowGroupReadError

ROWS_PER_GROUP = 32768  # 256 KiB of int64 per row group: four fill the 1 MiB disk


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 1 MiB tmpfs (needs root, as in the sandbox and CI containers; skipped elsewhere)."""
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:  # lazy: SQLite connections of finished decode threads may still hold files open
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """12 row groups of random int64 ids (too wide to narrow), about 3 MiB decoded."""
    folder = tmp_path / "datasets" / "training"
    folder.mkdir(parents=True)
    ids = np.random.default_rng(0).integers(-(2**62), 2**62, 12 * ROWS_PER_GROUP)
    pq.write_table(pa.table({"id": ids}), folder / "part-00000.parquet", row_group_size=ROWS_PER_GROUP)
    return folder


def fill(disk: Path) -> None:
    with open(disk / "filler", "wb", buffering=0) as filler:
        try:
            while True:
                filler.write(b"\0" * 65536)
        except OSError as error:
            assert error.errno == errno.ENOSPC


def test_warming_onto_a_full_disk_names_the_cache_folder_not_the_parquet_file(small_disk, dataset):
    cache_folder = small_disk / "cache"
    with pytest.raises(CacheStorageError) as raised:
        warm_cache(str(dataset), CacheConfig(cache_folder, 2 << 30), workers=2)
    message = str(raised.value)
    assert not isinstance(raised.value, RowGroupReadError)
    assert str(cache_folder) in message and "the disk is full" in message
    assert "cache.size_limit_bytes=2147483648" in message
    assert "part-00000" not in message and str(dataset) not in message
    assert is_disk_full(raised.value.__cause__)


def is_disk_full(error: BaseException | None) -> bool:
    """Whichever write meets the full disk first: a value file (ENOSPC) or diskcache's SQLite index (SQLITE_FULL)."""
    if isinstance(error, OSError):
        return error.errno == errno.ENOSPC
    return isinstance(error, sqlite3.OperationalError) and "database or disk is full" in str(error)


def test_a_cache_opened_on_a_full_disk_names_its_folder(small_disk, dataset):
    fill(small_disk)
    cache_folder = small_disk / "cache"
    with pytest.raises(CacheStorageError, match="opening it failed: the disk is full") as raised:
        warm_cache(str(dataset), CacheConfig(cache_folder, 2 << 30), workers=2)
    assert str(cache_folder) in str(raised.value) and "database or disk is full" in str(raised.value)


@pytest.mark.parametrize("write_queue_bytes", [0, 64 * 2**20], ids=["stores-on-decode-thread", "background-writer"])
def test_training_reads_every_row_when_the_cache_disk_fills(small_disk, dataset, write_queue_bytes, caplog):
    cache_folder = small_disk / "cache"
    config = CacheConfig(cache_folder, 2 << 30, write_queue_bytes=write_queue_bytes)
    expected = np.sort(pq.read_table(dataset)["id"].to_numpy())
    with caplog.at_level(logging.WARNING), RowGroupReader(str(dataset), batch_size=4096, cache=config,
                                                          workers=2) as reader:
        ids = np.sort(np.concatenate([batch["id"] for batch in reader]))
    stats = reader.stats  # after close: the background writer has stored (or failed to store) its queue
    np.testing.assert_array_equal(ids, expected)
    assert stats.cache_write_errors > 0  # the disk did fill: those row groups are read from Parquet next time
    assert any(str(cache_folder) in record.getMessage() and "the disk is full" in record.getMessage()
               for record in caplog.records)
