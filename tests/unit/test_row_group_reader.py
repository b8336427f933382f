"""RowGroupReader on real Parquet files: order, sharding, resume, cache, threads, torch. What it
accepts and what batches hold: test_reader_inputs.py."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from training_core.data import CacheConfig, ReaderStats, RowGroupReader, batch_to_torch
from training_core.data.order import build_epoch_layout
from training_core.data.order.invariants import rank_batches

from .conftest import read_ids, write_ids_dataset

FIXTURE_OK = [HealthCheck.function_scoped_fixture]


def same_batches(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@settings(max_examples=25, deadline=None, suppress_health_check=FIXTURE_OK)
@given(
    seed=st.integers(0, 10**6),
    epoch=st.integers(0, 3),
    world_size=st.integers(1, 4),
    batch_size=st.integers(1, 300),
    window=st.integers(1, 4),
    drop_last=st.booleans(),
    workers=st.sampled_from([1, 2, 4]),
    cached=st.booleans(),
)
def test_reader_matches_reference_order_on_every_rank(ids_dataset, tmp_path, seed, epoch, world_size, batch_size,
                                                      window, drop_last, workers, cached):
    # One cache for every example: row groups earlier examples stored come back as hits, others as misses.
    cache = CacheConfig(tmp_path / "cache", 50 * 2**20, shards=2) if cached else None
    per_rank = []
    for rank in range(world_size):
        kwargs = dict(batch_size=batch_size, seed=seed, epoch=epoch, world_size=world_size, rank=rank,
                      shuffle_buffer_row_groups=window, drop_last=drop_last)
        batches = read_ids(ids_dataset, workers=workers, cache=cache, **kwargs)
        with RowGroupReader(ids_dataset, **kwargs) as reader:
            sizes = reader.dataset.row_group_sizes
        layout = build_epoch_layout(sizes, seed=seed, epoch=epoch, world_size=world_size, batch_size=batch_size,
                                    shuffle=True, window_row_groups=window, drop_last=drop_last)
        assert same_batches(batches, rank_batches(layout, sizes, 0, world_size, rank, batch_size))
        per_rank.append(np.concatenate(batches) if batches else np.zeros(0, np.int64))
    assert len({len(p) for p in per_rank}) == 1, "ranks must yield the same number of rows (lockstep)"
    seen = np.concatenate(per_rank)
    if drop_last:
        assert len(np.unique(seen)) == len(seen)
    else:
        assert set(seen.tolist()) == set(range(1000))
        assert len(seen) - 1000 < world_size


@pytest.mark.parametrize("world_size,rank", [(1, 0), (3, 2)])
def test_workers_and_cache_never_change_the_order(ids_dataset, tmp_path, world_size, rank):
    common = dict(batch_size=64, seed=11, world_size=world_size, rank=rank, shuffle_buffer_row_groups=3)
    reference = read_ids(ids_dataset, workers=1, **common)
    assert same_batches(read_ids(ids_dataset, workers=4, **common), reference)
    cache = CacheConfig(tmp_path / "cache", 50 * 2**20, shards=2)
    cold = RowGroupReader(ids_dataset, workers=4, cache=cache, **common)
    assert same_batches([b["id"].copy() for b in cold], reference)
    assert cold.stats.cache_misses > 0 and cold.stats.cache_hits == 0
    cold.close()
    warm = RowGroupReader(ids_dataset, workers=3, cache=cache, **common)
    assert same_batches([b["id"].copy() for b in warm], reference)
    assert warm.stats.cache_hits > 0 and warm.stats.cache_misses == 0
    warm.close()


def test_exact_resume_from_json_state(ids_dataset):
    common = dict(batch_size=37, seed=5, shuffle_buffer_row_groups=2, workers=2)
    full = read_ids(ids_dataset, **common)
    reader = RowGroupReader(ids_dataset, **common)
    iterator = iter(reader)
    head = [next(iterator)["id"].copy() for _ in range(7)]
    state = json.loads(json.dumps(reader.state_dict()))
    reader.close()
    assert len(json.dumps(state)) < 400 and all(isinstance(v, (int, bool)) for v in state.values())
    fresh = RowGroupReader(ids_dataset, **common)
    fresh.load_state_dict(state)
    tail = [batch["id"].copy() for batch in fresh]
    assert same_batches(head + tail, full)
    assert fresh.state_dict()["epoch"] == 1 and fresh.state_dict()["samples_in_epoch"] == 0
    fresh.close()


@pytest.mark.parametrize("old_world,new_world,new_batch", [(3, 2, 37), (2, 5, 16), (4, 1, 50)])
def test_elastic_resume_loses_and_repeats_nothing(ids_dataset, old_world, new_world, new_batch):
    consumed, states = [], []
    for rank in range(old_world):
        reader = RowGroupReader(ids_dataset, batch_size=25, seed=9, world_size=old_world, rank=rank, workers=2)
        iterator = iter(reader)
        consumed += [next(iterator)["id"].copy() for _ in range(3)]
        states.append(reader.state_dict())
        reader.close()
    assert all(state == states[0] for state in states), "every rank must save the same global state"
    rest = []
    for rank in range(new_world):
        reader = RowGroupReader(ids_dataset, batch_size=new_batch, seed=9, world_size=new_world, rank=rank)
        reader.load_state_dict(states[rank % old_world])
        rest.append([batch["id"].copy() for batch in reader])
        reader.close()
    assert len({len(r) for r in rest}) == 1, "resumed ranks must stay in lockstep"
    everything = np.concatenate(consumed + [b for r in rest for b in r])
    padding = -1000 % old_world  # documented: the epoch's layout pads by wrapping around
    assert set(everything.tolist()) == set(range(1000)), "no sample may be lost"
    assert len(everything) == 1000 + padding, "no sample may repeat beyond the layout's padding"


def test_each_epoch_reorders_and_covers_everything(ids_dataset):
    reader = RowGroupReader(ids_dataset, batch_size=100, seed=1, workers=2)
    first = np.concatenate([b["id"].copy() for b in reader])
    second = np.concatenate([b["id"].copy() for b in reader])
    assert reader.epoch == 2
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(1000))
    assert not np.array_equal(first, second)
    reader.set_epoch(0)
    assert np.array_equal(np.concatenate([b["id"].copy() for b in reader]), first)
    reader.close()


@pytest.mark.parametrize(("arguments", "error", "message"), [
    ({"batch_size": 2.5}, TypeError, "batch_size must be an integer, got 2.5"),
    ({"seed": -5}, ValueError, "seed must be >= 0, got -5"),
    ({"epoch": -1}, ValueError, "epoch must be >= 0, got -1"),
    ({"world_size": 0}, ValueError, "world_size must be >= 1, got 0"),
    ({"workers": 0}, ValueError, "workers must be >= 1, got 0"),
    ({"rank": True}, TypeError, "rank must be an integer, got True"),
    ({"columns": "id"}, TypeError, "columns must be a list of column names, got 'id'"),
    ({"columns": []}, ValueError, r"columns must name at least one column \(None reads them all\)"),
    ({"columns": ["id", "id"]}, ValueError, r"columns names a column twice: \['id', 'id'\]"),
])
def test_reader_arguments_are_checked_by_name_before_any_thread_starts(ids_dataset, arguments, error, message):
    with pytest.raises(error, match=f"^{message}$"):
        RowGroupReader(ids_dataset, **arguments)
    with RowGroupReader(ids_dataset) as reader, pytest.raises(ValueError, match="epoch must be an integer >= 0, got -2"):
        reader.set_epoch(-2)


def test_numpy_integer_arguments_give_a_json_state_that_loads_back(ids_dataset):
    with RowGroupReader(ids_dataset, batch_size=np.int64(100), seed=np.int64(3), epoch=np.int32(1)) as reader:
        next(iter(reader))
        state = reader.state_dict()
    assert json.loads(json.dumps(state)) == state and state["seed"] == 3 and state["epoch"] == 1
    with RowGroupReader(ids_dataset, batch_size=100, seed=3) as reader:
        reader.load_state_dict(state)
        assert reader.state_dict() == state


def test_a_damaged_reader_state_names_its_bad_field_and_leaves_the_reader_as_it_was(ids_dataset):
    from training_core.data.reader import ReaderStateError

    with RowGroupReader(ids_dataset, batch_size=100) as reader:
        good = reader.state_dict()
        expected = [batch["id"].copy() for batch in reader]
    for state, message in [
        (None, r"reader state must be a dict \(from state_dict\(\)\), got NoneType"),
        ({**good, "epoch": "1"}, "reader state epoch='1': expected an integer >= 0"),
        ({**good, "samples_in_epoch": -1}, "reader state samples_in_epoch=-1: expected an integer >= 0"),
        ({**good, "shuffle": 1}, "reader state shuffle=1: expected true or false"),
        ({key: value for key, value in good.items() if key != "seed"}, "reader state has no 'seed'; it has"),
        ({**good, "samples_in_epoch": 5000, "seed": 9},
         r"reader state samples_in_epoch=5000 is past the end of its epoch \(1000 samples at world size 1\)"),
    ]:
        with RowGroupReader(ids_dataset, batch_size=100) as reader:
            with pytest.raises(ReaderStateError, match=message):
                reader.load_state_dict(state)
            assert reader.state_dict() == good
            assert same_batches([batch["id"].copy() for batch in reader], expected)


def test_state_of_another_dataset_is_rejected(ids_dataset, tmp_path):
    other = write_ids_dataset(tmp_path / "other", [(10, 5)])
    state = RowGroupReader(ids_dataset).state_dict()
    with pytest.raises(ValueError, match="1000 rows"):
        RowGroupReader(other).load_state_dict(state)


def test_state_of_a_dataset_with_the_same_rows_in_other_row_groups_is_rejected(ids_dataset, tmp_path):
    """The order depends on the row-group sizes: a state of 1 000 rows in other row groups would
    resume into another order, repeating some rows and never delivering others."""
    from training_core.data.reader import ReaderStateError

    regrouped = write_ids_dataset(tmp_path / "regrouped", [(1000, 250)])
    with RowGroupReader(ids_dataset, batch_size=100, seed=3) as reader:
        next(iter(reader))
        state = json.loads(json.dumps(reader.state_dict()))
    with RowGroupReader(regrouped, batch_size=100, seed=3) as reader:
        with pytest.raises(ReaderStateError, match="other row groups .*row_group_sizes_digest"):
            reader.load_state_dict(state)
        assert reader.state_dict()["samples_in_epoch"] == 0
    # a state saved before the fingerprint existed still loads, checked by its row count only
    old = {key: value for key, value in state.items() if key != "row_group_sizes_digest"}
    with RowGroupReader(ids_dataset, batch_size=100, seed=3) as reader:
        reader.load_state_dict(old)
        assert reader.state_dict() == state


def test_batch_to_torch_shares_memory(ids_dataset):
    with RowGroupReader(ids_dataset, batch_size=32, columns=["id", "tokens"]) as reader:
        batch = next(iter(reader))
        tensors = batch_to_torch(batch)
    assert tensors["tokens"].shape == (32, 4) and tensors["tokens"].dtype == torch.int32
    assert tensors["tokens"].data_ptr() == batch["tokens"].ctypes.data
    tensors["id"][0] = -1
    assert batch["id"][0] == -1
    with pytest.raises(TypeError, match="'s'"):
        batch_to_torch({"s": np.array(["x"], dtype=object)})


@pytest.mark.parametrize("policy", ["evict", "stop_admitting"])
def test_epochs_over_a_dataset_larger_than_the_cache(tmp_path, policy):
    """What the benchmark's policy comparison measures: with room for a quarter of the row
    groups, ``stop_admitting`` keeps the first epoch's entries and hits exactly those every later
    epoch without writing; ``evict`` stores every miss and evicts to make room. Either way the
    quota holds and the batches are those of a reader without cache."""
    data = write_ids_dataset(tmp_path / "ids", [(1000, 50)], token_width=512)
    common = dict(batch_size=64, seed=5, shuffle_buffer_row_groups=2, workers=2)
    epochs = 4
    with RowGroupReader(data, **common) as uncached:
        reference = [[b["id"].copy() for b in uncached] for _ in range(epochs)]
    # one shard: its SQLite file counts too (~32 kB and growing), then ~51 kB per entry: 5 of 20 row groups fit
    quota = 350_000
    config = CacheConfig(tmp_path / "cache", quota, policy=policy, shards=1)
    per_epoch = []
    with RowGroupReader(data, cache=config, **common) as reader:
        for epoch in range(epochs):
            before = reader.stats
            assert same_batches([b["id"].copy() for b in reader], reference[epoch]), f"epoch {epoch}"
            after = reader.stats
            per_epoch.append({name: getattr(after, f"cache_{name}") - getattr(before, f"cache_{name}")
                              for name in ("hits", "misses", "evictions", "rejected", "dropped")})
    from training_core.data.cache import RowGroupCache

    cache = RowGroupCache(config)
    stored_entries, volume = len(cache), cache.volume()
    cache.close()
    assert volume <= quota and 0 < stored_entries < 20
    first, later = per_epoch[0], per_epoch[1:]
    assert first["hits"] == 0 and first["misses"] == 20 and all(e["dropped"] == 0 for e in per_epoch)
    if policy == "stop_admitting":
        assert first["rejected"] == 20 - stored_entries and first["evictions"] == 0
        for epoch in later:  # the same entries serve every epoch; every miss is refused, none evicts
            assert epoch == {"hits": stored_entries, "misses": 20 - stored_entries, "evictions": 0,
                             "rejected": 20 - stored_entries, "dropped": 0}
    else:
        assert first["rejected"] == 0 and first["evictions"] == 20 - stored_entries
        for epoch in later:  # every miss is stored, each making room by evicting the oldest
            assert epoch["rejected"] == 0 and epoch["evictions"] >= 1
            assert epoch["hits"] + epoch["misses"] == 20


def test_stats_report_rows_bytes_and_cache(ids_dataset, tmp_path):
    reader = RowGroupReader(ids_dataset, batch_size=100, cache=CacheConfig(tmp_path / "c", 2**26, shards=1))
    rows = sum(len(b["id"]) for b in reader)
    stats = reader.stats
    row_groups = len(reader.dataset.row_groups)
    reader.close()
    assert isinstance(stats, ReaderStats)
    assert stats.rows == rows == 1000 and stats.batches == 10
    assert stats.bytes == 1000 * (8 + 16) and stats.rows_per_s > 0
    assert row_groups == 15 and stats.cache_misses == row_groups and stats.cache_hits == 0
    assert 0.0 <= stats.stall_fraction <= 1.0
    assert set(stats.as_dict()) >= {"rows", "bytes", "rows_per_s", "bytes_per_s", "cache_hits", "cache_misses",
                                    "cache_evictions", "cache_corruptions", "consumer_wait_s", "stall_fraction"}


def test_transform_runs_and_is_part_of_the_cache_key(ids_dataset, tmp_path):
    cache = CacheConfig(tmp_path / "c", 2**26, shards=1)

    def double(columns):
        return {**columns, "id": columns["id"] * 2}

    def read(transform, version):
        with RowGroupReader(ids_dataset, batch_size=500, shuffle=False, cache=cache, transform=transform,
                            transform_version=version) as reader:
            return np.concatenate([b["id"] for b in reader]), reader.stats

    plain, _ = read(None, "none")
    doubled, stats = read(double, "double-v1")
    assert stats.cache_hits == 0, "a new transform version must not hit entries of another"
    assert np.array_equal(doubled, plain * 2)
    again, stats = read(double, "double-v1")
    assert stats.cache_misses == 0 and np.array_equal(again, doubled)


def test_gathered_first_window_equals_the_scattered_window():
    from training_core.data.workers import GatheredWindow, assemble_window

    rng = np.random.default_rng(4)
    ragged = np.empty(5, dtype=object)
    ragged[:] = [np.arange(i, dtype=np.int16) for i in range(5)]
    parts = [
        {"id": np.arange(7, dtype=np.int64), "tok": rng.integers(0, 9, (7, 3)).astype(np.uint8),
         "text": np.array([f"a{i}" for i in range(7)], dtype=object), "r": np.concatenate([ragged, ragged[:2]])},
        {"id": np.arange(7, 12, dtype=np.int64), "tok": rng.integers(0, 9, (5, 3)).astype(np.uint8),
         "text": np.array([f"b{i}" for i in range(5)], dtype=object), "r": ragged},
    ]
    dtypes = [{"id": np.dtype(np.int64), "tok": np.dtype(np.int32), "text": np.dtype(object), "r": np.dtype(object)}] * 2
    order = rng.permutation(12)
    inverse = np.empty(12, dtype=np.int64)
    inverse[order] = np.arange(12)
    whole = assemble_window(parts, inverse, dtypes)
    gathered = GatheredWindow(parts, dtypes, [7, 5], order)
    for lo, hi in [(0, 12), (0, 1), (3, 8), (11, 12), (5, 5)]:
        rows = gathered.rows(lo, hi)
        for name in whole:
            assert rows[name].dtype == whole[name].dtype
            assert [np.asarray(x).tolist() for x in rows[name]] == [np.asarray(x).tolist() for x in whole[name][lo:hi]]


def test_window_buffers_are_reused_only_after_every_view_is_gone():
    from training_core.data.window_buffers import WindowBuffers

    pool = WindowBuffers(max_free=2)
    window = pool.empty((4, 3), np.int32)
    window[:] = 7
    kept = torch.from_numpy(window[1:3])  # a batch the consumer keeps, as a tensor
    del window
    other = pool.empty((4, 3), np.int32)  # the kept rows are still alive: fresh memory
    assert pool.reused == 0 and not np.shares_memory(other, kept.numpy())
    other[:] = -1
    assert (kept == 7).all()
    address = kept.data_ptr()
    del kept
    again = pool.empty((4, 3), np.int32)  # now the first block is free again
    assert pool.reused == 1 and again.ctypes.data <= address < again.ctypes.data + again.nbytes
    assert pool.empty(2, object).dtype == object and pool.reused == 1  # object columns are never pooled


def test_batches_kept_by_the_consumer_survive_reused_window_buffers(ids_dataset):
    """Keep every third batch (numpy and torch) across epochs, scribble over the others before
    dropping them: reused window memory must never change a kept batch nor leak into a later one."""
    kept, snapshots = [], []
    with RowGroupReader(ids_dataset, batch_size=32, shuffle_buffer_row_groups=2, columns=["id", "tokens"],
                        prefetch_batches=16, workers=2) as reader:
        for _ in range(3):
            for index, batch in enumerate(reader):
                expected = batch["id"][:, None] * 10 + np.arange(4)
                assert np.array_equal(batch["tokens"], expected)
                if index % 3 == 0:
                    kept.append((batch, batch_to_torch(batch)))
                    snapshots.append({name: column.copy() for name, column in batch.items()})
                else:
                    batch["tokens"][:] = -1
                    batch["id"][:] = -1
        reused = reader._window_buffers.reused
    assert reused > 0, "the test must exercise reused window memory"
    for (batch, tensors), snapshot in zip(kept, snapshots):
        for name, column in snapshot.items():
            assert np.array_equal(batch[name], column)
            assert np.array_equal(tensors[name].numpy(), column)


def _reader_threads(reader: RowGroupReader) -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith(f"tessera-reader-{reader._id}-")]


def test_an_iterator_collected_on_one_of_its_own_threads_still_stops_every_thread(tmp_path, monkeypatch):
    """An abandoned iterator in a reference cycle is finalized by whichever thread the cyclic GC
    runs on; on one of its decode threads, closing the pipeline joined the current thread
    (RuntimeError in the finalizer) and the cache writer was never closed."""
    import gc
    import sys
    import threading
    import time

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    schema = pa.schema([pa.field("x", pa.int64(), nullable=False)])
    pq.write_table(pa.table({"x": np.arange(20_000)}, schema=schema), tmp_path / "a.parquet", row_group_size=100)
    dropped = threading.Event()

    def collect_once_dropped(columns):
        if dropped.is_set():
            dropped.clear()
            gc.collect()  # stands in for an automatic collection that happens to run on this decode thread
        time.sleep(0.005)
        return columns

    gc.disable()  # the collection happens exactly there, not on the test's thread
    try:
        reader = RowGroupReader(tmp_path / "a.parquet", batch_size=50, workers=2, transform=collect_once_dropped,
                                transform_version="gc", cache=CacheConfig(tmp_path / "c", 1 << 30),
                                prefetch_batches=1024)
        iterator = iter(reader)
        next(iterator)
        cycle: list = [iterator]
        cycle.append(cycle)
        del iterator, cycle
        dropped.set()
        deadline = time.monotonic() + 10
        while _reader_threads(reader) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        gc.enable()
    assert not dropped.is_set(), "the transform never ran the collection"
    assert [hook.exc_value for hook in unraisable] == []
    assert _reader_threads(reader) == []
    reader.close()


def test_a_transform_slower_than_the_read_timeout_is_named_not_blamed_on_storage(tmp_path):
    import time

    from training_core.data.workers import TransformError

    pq.write_table(pa.table({"x": pa.array(range(10), pa.int64())}), tmp_path / "a.parquet")

    def slow(columns):
        time.sleep(0.6)  # e.g. tokenizing a big row group
        return columns

    with RowGroupReader(tmp_path / "a.parquet", batch_size=10, transform=slow, transform_version="slow",
                        read_timeout_s=0.3) as reader:
        with pytest.raises(TransformError, match=r"a\.parquet row group 0: the transform has not returned "
                                                 r"read_timeout_s=0\.3s after the row group's read started"):
            list(reader)


def test_close_from_another_thread_ends_a_waiting_iteration_with_reader_closed(tmp_path):
    import threading
    import time

    from training_core.data.workers import ReaderClosedError

    pq.write_table(pa.table({"x": pa.array(range(30), pa.int64())}), tmp_path / "a.parquet", row_group_size=10)

    def slow_after_the_first(columns):
        if columns["x"][0] > 0:
            time.sleep(0.8)
        return columns

    reader = RowGroupReader(tmp_path / "a.parquet", batch_size=10, shuffle=False, shuffle_buffer_row_groups=1,
                            workers=1, transform=slow_after_the_first, transform_version="slow")
    iterator = iter(reader)
    assert next(iterator)["x"].tolist() == list(range(10))
    closer = threading.Timer(0.2, reader.close)
    closer.start()
    with pytest.raises(ReaderClosedError, match=r"reader closed \(close\(\) from another thread\?\) while this "
                                                r"iteration waited for a batch"):
        next(iterator)  # the next row group is still in its transform
    closer.join()
    with pytest.raises(StopIteration):
        next(iterator)


def test_a_rejected_state_leaves_a_running_iteration_running(ids_dataset):
    from training_core.data.reader import ReaderStateError

    with RowGroupReader(ids_dataset, batch_size=100) as reader:
        expected = [batch["id"].copy() for batch in reader]
    with RowGroupReader(ids_dataset, batch_size=100) as reader:
        iterator = iter(reader)
        first = next(iterator)["id"].copy()
        before = reader.state_dict()
        with pytest.raises(ReaderStateError, match="past the end of its epoch"):
            reader.load_state_dict({**before, "samples_in_epoch": 5000, "seed": 9})
        assert reader.state_dict() == before and reader.seed == 0
        assert same_batches([first] + [batch["id"].copy() for batch in iterator], expected)
        assert reader.state_dict()["epoch"] == 1
