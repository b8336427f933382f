"""Row-group cache quota: evict vs stop_admitting, entries too big, two processes sharing one
directory, and store transactions that fail or are killed midway (nothing torn, nothing lost)."""
from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from training_core.data import CacheConfig
from training_core.data.cache import _SQLITE_SLACK, RowGroupCache
from training_core.data.cache_payload import encode_payload
from training_core.data.stats import StatsRecorder

from .conftest import entry, stored_entry


def test_evict_policy_stays_under_quota_and_keeps_newest(tmp_path):
    cache = RowGroupCache(CacheConfig(tmp_path / "c", 1_000_000, policy="evict", shards=1))
    for i in range(30):
        assert cache.put(f"k{i}", entry(i))
        assert cache.volume() <= 1_000_000
    assert cache.counters.evictions > 0
    assert cache.get("k29", "k29")[0]["x"][0, 0] == 29
    assert cache.get("k0", "k0") is None
    cache.close()


def test_stop_admitting_policy_keeps_first_entries(tmp_path):
    cache = RowGroupCache(CacheConfig(tmp_path / "c", 1_000_000, policy="stop_admitting", shards=1))
    stored = [cache.put(f"k{i}", entry(i)) for i in range(30)]
    assert stored[0] and not stored[-1]
    assert cache.counters.evictions == 0 and cache.counters.rejected == stored.count(False)
    assert cache.volume() <= 1_000_000
    assert cache.get("k0", "k0")[0]["x"][0, 0] == 0
    cache.close()


def test_entry_larger_than_a_shard_is_not_stored(tmp_path):
    cache = RowGroupCache(CacheConfig(tmp_path / "c", 400_000, shards=4))
    assert not cache.put("big", entry(1))
    assert cache.counters.rejected == 1 and len(cache) == 0
    cache.close()


@pytest.mark.parametrize("batched", [False, True])
def test_evict_refuses_an_entry_too_big_beside_the_sqlite_pages_without_evicting_anything(tmp_path, batched):
    """Evicting frees the entries' bytes, never the shard's own SQLite pages (32 KiB here): an entry
    within the per-entry bound that cannot fit beside those pages is refused with nothing evicted;
    one that fits evicts only the oldest entries it needs."""
    limit = 400_000
    cache = RowGroupCache(CacheConfig(tmp_path / "c", limit, policy="evict", shards=1))
    keys = [f"k{i}" for i in range(10)]
    assert all(cache.put(key, entry(i, rows=300)) for i, key in enumerate(keys))  # ~30 kB each
    pages = cache.volume() - cache.stored(keys)[1]
    too_big, fits = entry(10, rows=3670), entry(11)  # ~367 kB, ~100 kB
    needed = len(encode_payload(too_big)) + len("too_big") + _SQLITE_SLACK
    assert limit - pages < needed <= limit, "the entry must pass the per-entry bound, yet not fit beside the pages"
    if batched:
        stored = cache.put_many([stored_entry("too_big", too_big), stored_entry("fits", fits)])
    else:
        stored = [cache.put("too_big", too_big), cache.put("fits", fits)]
    assert stored == [False, True]
    # "fits" needs ~51 kB more than is free: one 30 kB entry is too little, two are enough
    assert cache.counters.rejected == 1 and cache.counters.evictions == 2
    assert cache.stored(keys[:2])[0] == 0 and cache.stored(keys[2:])[0] == 8
    assert cache.volume() <= limit
    cache.close()


def _writer(directory: str, policy: str, start: int, barrier, result, batch: int) -> None:
    cache = RowGroupCache(CacheConfig(directory, 1_500_000, policy=policy, shards=1))  # one shard: every store contends
    barrier.wait(timeout=60)  # both processes store at once, so each transaction races the other's
    peak, torn = 0, 0
    for i in range(start, start + 300, batch):
        # sizes from 10 to 210 kB: a store the peer commits meanwhile changes the volume, so
        # a volume read outside the lock would leave too little room for this store
        sized = [entry(j, rows=100 + (j * 7919) % 2000) for j in range(i, i + batch)]
        if batch == 1:
            cache.put(f"k{i}", sized[0])
        else:  # several entries per transaction, as the background writer stores them
            cache.put_many([stored_entry(f"k{j}", columns) for j, columns in zip(range(i, i + batch), sized)])
        peak = max(peak, cache.volume())
        other = cache.get(f"k{(i + 1000) % 2000}", "peer")  # read what the peer process may be writing
        if other is not None and not np.all(other[0]["x"][:, 0] == other[0]["x"][0, 0]):
            torn += 1
    result.put((peak, torn, cache.counters.corruptions))
    cache.close()


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("policy", ["evict", "stop_admitting"])
def test_two_processes_never_exceed_the_quota(tmp_path, policy, batch):
    context = multiprocessing.get_context("spawn")
    result, barrier = context.Queue(), context.Barrier(2)
    directory = str(tmp_path / "shared")
    workers = [context.Process(target=_writer, args=(directory, policy, s, barrier, result, batch)) for s in (0, 1000)]
    for process in workers:
        process.start()
    outcomes = [result.get(timeout=120) for _ in workers]
    for process in workers:
        process.join(timeout=60)
        assert process.exitcode == 0
    cache = RowGroupCache(CacheConfig(directory, 1_500_000, policy=policy, shards=1))
    assert cache.volume() <= 1_500_000
    assert len(cache) > 0
    cache.close()
    for peak, torn, corruptions in outcomes:
        assert peak <= 1_500_000 and torn == 0 and corruptions == 0
    files = sum(p.stat().st_size for p in Path(directory).rglob("*.val"))
    assert files <= 1_500_000


@pytest.mark.parametrize("policy", ["evict", "stop_admitting"])
def test_batched_stores_obey_the_quota_entry_by_entry(tmp_path, policy):
    cache = RowGroupCache(CacheConfig(tmp_path / "c", 1_000_000, policy=policy, shards=1))
    stored = []
    for begin in range(0, 30, 10):
        stored += cache.put_many([stored_entry(f"k{i}", entry(i)) for i in range(begin, begin + 10)])
        assert cache.volume() <= 1_000_000
    fits = stored.count(True)
    if policy == "evict":
        assert all(stored) and cache.counters.evictions > 0, "evict admits every entry, making room first"
        assert cache.get("k29", "k29")[0]["x"][0, 0] == 29 and cache.get("k0", "k0") is None
    else:
        assert 0 < fits < 30 and stored == [True] * fits + [False] * (30 - fits), "the first stay, the rest are refused"
        assert cache.counters.rejected == 30 - fits and cache.counters.evictions == 0
    assert cache.counters.stored_bytes > 0
    names = {path.parent.name for path in (tmp_path / "c").rglob("*.val")}
    assert names <= set("0123456789abcdef"), "value files live in 16 fixed subdirectories per shard"
    cache.close()


def test_a_failed_batch_stores_nothing_leaves_no_files_and_is_counted(tmp_path, monkeypatch):
    from training_core.data.cache import _ValueDisk

    cache = RowGroupCache(CacheConfig(tmp_path / "c", 2**26, shards=1))
    writes = []
    original = _ValueDisk._write

    def failing_write(self, full_path, iterator, mode, encoding=None):
        writes.append(full_path)
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        return original(self, full_path, iterator, mode, encoding)

    monkeypatch.setattr(_ValueDisk, "_write", failing_write)
    assert cache.put_many([stored_entry(f"k{i}", entry(i)) for i in range(3)]) == [False, False, False]
    assert cache.counters.write_errors == 3 and len(cache) == 0, "the whole transaction rolled back"
    assert StatsRecorder().snapshot(cache.counters).cache_write_errors == 3, "reader stats and MLflow show them"
    assert not list((tmp_path / "c").rglob("*.val")), "the file written before the failure was deleted"
    assert cache.put_many([stored_entry("k9", entry(9))]) == [True] and cache.get("k9", "k9") is not None
    cache.close()


def _fail_on_write(number: int, failure) -> Callable:
    """A ``_ValueDisk._write`` that calls ``failure()`` instead of writing the ``number``-th value file."""
    from training_core.data.cache import _ValueDisk

    original, writes = _ValueDisk._write, []

    def write(self, full_path, iterator, mode, encoding=None):
        writes.append(full_path)
        if len(writes) == number:
            failure()
        return original(self, full_path, iterator, mode, encoding)

    return write


def _disk_full() -> None:
    raise OSError(28, "No space left on device")


def _assert_every_row_has_its_file(cache: RowGroupCache, keys: list[str]) -> None:
    """What ``stored()`` counts is there: each entry's value file exists, a pooled and a plain get hit it."""
    shard = cache._cache._shards[0]
    rows = shard._sql("SELECT key, filename FROM Cache").fetchall()
    assert sorted(key for key, _ in rows) == sorted(keys)
    assert all(os.path.exists(os.path.join(shard.directory, name)) for _, name in rows)
    assert cache.stored(keys) == (len(keys), sum(os.path.getsize(os.path.join(shard.directory, name)) for _, name in rows))
    for key in keys:
        assert cache.get(key, key)[0]["x"][0, 0] == int(key[1:])
    assert cache.counters.misses == 0


def test_a_batch_that_evicts_then_fails_keeps_the_evicted_entries_and_their_files(tmp_path, monkeypatch):
    """Each store of the batch evicts an entry first; the second then hits a full disk: the rollback
    brings back the evicted rows, so their value files must still be there."""
    from training_core.data.cache import _ValueDisk

    directory = tmp_path / "c"
    cache = RowGroupCache(CacheConfig(directory, 400_000, policy="evict", shards=1))
    assert [cache.put(f"k{i}", entry(i)) for i in range(3)] == [True] * 3
    monkeypatch.setattr(_ValueDisk, "_write", _fail_on_write(2, _disk_full))
    assert cache.put_many([stored_entry("k10", entry(10)), stored_entry("k11", entry(11))]) == [False, False]
    assert cache.counters.write_errors == 2 and cache.counters.evictions == 0
    _assert_every_row_has_its_file(cache, ["k0", "k1", "k2"])
    assert len(list(directory.rglob("*.val"))) == 3, "the file the failed batch wrote was deleted"
    monkeypatch.undo()  # a committed batch deletes the files of the entries it evicted
    assert cache.put_many([stored_entry("k10", entry(10)), stored_entry("k11", entry(11))]) == [True, True]
    assert cache.counters.evictions == 2 and "k0" not in cache._files and "k10" in cache._files
    _assert_every_row_has_its_file(cache, ["k2", "k10", "k11"])
    assert len(list(directory.rglob("*.val"))) == 3
    cache.close()


def test_a_batch_that_replaces_an_entry_then_fails_keeps_the_old_entry_and_its_file(tmp_path, monkeypatch):
    """Storing a key that is already there (another process stored it meanwhile) replaces its row;
    a rollback brings the old row back, so its file must stay until the commit."""
    from training_core.data.cache import _ValueDisk

    directory = tmp_path / "c"
    cache = RowGroupCache(CacheConfig(directory, 2**26, shards=1))
    assert cache.put("k1", entry(1))
    monkeypatch.setattr(_ValueDisk, "_write", _fail_on_write(2, _disk_full))
    assert cache.put_many([stored_entry("k1", entry(1)), stored_entry("k2", entry(2))]) == [False, False]
    _assert_every_row_has_its_file(cache, ["k1"])
    monkeypatch.undo()
    assert cache.put("k1", entry(1)) and len(cache) == 1
    _assert_every_row_has_its_file(cache, ["k1"])
    assert len(list(directory.rglob("*.val"))) == 1, "the replaced entry's file was deleted after the commit"
    cache.close()


def _killed_inside_a_batch(directory: str) -> None:
    """Stores two entries in one batch under a full quota and is SIGKILLed instead of writing the second."""
    from training_core.data.cache import _ValueDisk

    cache = RowGroupCache(CacheConfig(directory, 400_000, policy="evict", shards=1))
    _ValueDisk._write = _fail_on_write(2, lambda: os.kill(os.getpid(), signal.SIGKILL))
    cache.put_many([stored_entry("k10", entry(10)), stored_entry("k11", entry(11))])


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_writer_killed_after_evicting_inside_a_batch_leaves_the_evicted_entries_whole(tmp_path):
    directory = str(tmp_path / "c")
    cache = RowGroupCache(CacheConfig(directory, 400_000, policy="evict", shards=1))
    assert [cache.put(f"k{i}", entry(i)) for i in range(3)] == [True] * 3
    writer = multiprocessing.get_context("spawn").Process(target=_killed_inside_a_batch, args=(directory,))
    writer.start()
    writer.join(timeout=120)
    assert writer.exitcode == -signal.SIGKILL
    _assert_every_row_has_its_file(cache, ["k0", "k1", "k2"])  # SQLite rolled the eviction back
    assert cache.remove_orphan_files(min_age_s=0) == 1, "only the killed batch's own file is left over"
    cache.close()
