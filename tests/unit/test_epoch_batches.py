"""EpochBatches: the training loop's batches over several epochs, from one reader."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from training_core.data import CacheConfig, RowGroupReader
from training_core.data.batch_columns import TRAINING_COLUMNS
from training_core.train.batches import DEFAULT_CACHE_SIZE_LIMIT_BYTES, EpochBatches
from training_core.train.config import TrainingConfig

ROWS, SEQ = 120, 8


@pytest.fixture()
def packed(tmp_path: Path) -> SimpleNamespace:
    """A packed dataset whose row r holds tokens r*SEQ ... r*SEQ+SEQ-1, so every row is recognizable."""
    tokens = np.arange(ROWS * SEQ, dtype=np.int32).reshape(ROWS, SEQ)
    column = pa.FixedSizeListArray.from_arrays(pa.array(tokens.ravel()), SEQ)
    directory = tmp_path / "train"
    directory.mkdir()
    pq.write_table(pa.table({"input_ids": column, "labels": column}), directory / "part-0.parquet", row_group_size=16)
    return SimpleNamespace(train_dirs=[str(directory)], cache_dir=str(tmp_path / "cache"), cache_size_limit_bytes=None,
                           cache_policy="evict")


def _config(**overrides) -> TrainingConfig:
    return TrainingConfig(num_workers=2, micro_batch_size=4, max_steps=10**6, shuffle_buffer_row_groups=2, **overrides)


def _rows(batch) -> list[int]:
    return [int(row[0]) // SEQ for row in np.asarray(batch["input_ids"])]


def _per_epoch_reference(inputs, config: TrainingConfig, rank: int, epochs: int) -> list[list[int]]:
    """What a fresh reader per epoch yields: the order is a pure function of (seed, epoch, rank)."""
    out = []
    for epoch in range(epochs):
        with RowGroupReader(inputs.train_dirs, columns=TRAINING_COLUMNS, batch_size=config.micro_batch_size,
                            seed=config.data_seed, epoch=epoch, shuffle_buffer_row_groups=config.shuffle_buffer_row_groups,
                            rank=rank, world_size=config.num_workers, workers=1,
                            cache=CacheConfig(Path(inputs.cache_dir), DEFAULT_CACHE_SIZE_LIMIT_BYTES),
                            drop_last=True) as reader:
            out.extend(_rows(batch) for batch in reader)
    return out


@pytest.mark.parametrize("rank", [0, 1])
def test_epochs_from_one_reader_match_a_fresh_reader_per_epoch_and_count_once(packed, rank):
    config = _config(max_epochs=3)
    batches = EpochBatches(packed, config, rank, config.num_workers, 0, None)
    seen, epochs = [], []
    while (batch := batches.next()) is not None:
        assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
        seen.append(_rows(batch))
        epochs.append(batches.epoch)
    stats = batches.stats()
    batches.close()

    assert seen == _per_epoch_reference(packed, config, rank, epochs=3)
    per_epoch = ROWS // config.num_workers // config.micro_batch_size
    assert epochs == [e for e in range(3) for _ in range(per_epoch)]
    assert batches.epoch == 3
    assert stats["batches"] == len(seen) and stats["rows"] == len(seen) * config.micro_batch_size
    assert not any(key.endswith("_per_s") for key in stats) and "stall_fraction" not in stats


def test_a_state_saved_at_an_epochs_end_resumes_in_the_next_epoch(packed):
    config = _config(max_epochs=2)
    first = EpochBatches(packed, config, 0, config.num_workers, 0, None)
    per_epoch = ROWS // config.num_workers // config.micro_batch_size
    for _ in range(per_epoch):
        first.next()
    state = first.state_dict()
    rest_uninterrupted = []
    while (batch := first.next()) is not None:
        rest_uninterrupted.append(_rows(batch))
    first.close()

    resumed = EpochBatches(packed, config, 0, config.num_workers, 0, state)
    assert resumed.epoch == 1
    rest = []
    while (batch := resumed.next()) is not None:
        rest.append(_rows(batch))
    resumed.close()
    assert rest == rest_uninterrupted and len(rest) == per_epoch


def _drain(batches: EpochBatches) -> list[list[int]]:
    rows = []
    while (batch := batches.next()) is not None:
        rows.append(_rows(batch))
    return rows


@pytest.mark.parametrize("max_epochs", [1, 2])
def test_a_state_saved_after_the_last_batch_of_the_last_epoch_resumes_with_nothing_left(packed, max_epochs):
    # After the last batch of an epoch the reader already points at the next epoch: a checkpoint
    # taken then must not resume into an epoch past max_epochs.
    config = _config(max_epochs=max_epochs)
    first = EpochBatches(packed, config, 0, config.num_workers, 0, None)
    per_epoch = ROWS // config.num_workers // config.micro_batch_size
    for _ in range(per_epoch * max_epochs):
        assert first.next() is not None
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    assert first.next() is None and first.epoch == max_epochs
    first.close()
    assert state["epoch"] == max_epochs and state["samples_in_epoch"] == 0

    resumed = EpochBatches(packed, config, 0, config.num_workers, 0, state)
    assert resumed.epoch == max_epochs
    assert resumed.next() is None and resumed.next() is None
    assert resumed.state_dict() == state
    resumed.close()


@pytest.mark.parametrize("max_epochs", [1, 2])
def test_resuming_after_any_batch_continues_the_uninterrupted_sequence_exactly(packed, max_epochs):
    config = _config(max_epochs=max_epochs)
    uninterrupted_batches = EpochBatches(packed, config, 0, config.num_workers, 0, None)
    uninterrupted = _drain(uninterrupted_batches)
    uninterrupted_batches.close()
    assert len(uninterrupted) == max_epochs * (ROWS // config.num_workers // config.micro_batch_size)

    for stop in range(len(uninterrupted) + 1):
        first = EpochBatches(packed, config, 0, config.num_workers, 0, None)
        before = [_rows(first.next()) for _ in range(stop)]
        state = json.loads(json.dumps(first.state_dict()))
        first.close()
        resumed = EpochBatches(packed, config, 0, config.num_workers, 0, state)
        after = _drain(resumed)
        resumed.close()
        assert before + after == uninterrupted, f"resumed after batch {stop}"
        assert resumed.epoch == max_epochs


def test_the_dataset_is_listed_once_for_all_epochs(packed, monkeypatch):
    import training_core.data.reader as reader_module

    calls = []
    real_index = reader_module.index_dataset
    monkeypatch.setattr(reader_module, "index_dataset", lambda *args: calls.append(args) or real_index(*args))
    config = _config(max_epochs=3)
    batches = EpochBatches(packed, config, 0, config.num_workers, 0, None)
    count = 0
    while batches.next() is not None:
        count += 1
    batches.close()
    assert count == 3 * (ROWS // config.num_workers // config.micro_batch_size)
    assert len(calls) == 1, "listing and footers are read again at every epoch"


def test_training_reads_the_cache_under_the_quota_and_policy_it_was_warmed_with(packed):
    # Warmed by row_group_cache under the resource's quota with stop_admitting: training must not
    # grow the cache past that quota (nor, with evict, push out what warming kept).
    from training_core.data import warm_cache
    from training_core.data.cache import RowGroupCache

    row_groups = ROWS // 16
    for quota in range(100_000, 400_000, 25_000):  # the smallest that holds some row groups, not all
        warmed = CacheConfig(Path(packed.cache_dir) / str(quota), quota, policy="stop_admitting")
        before = warm_cache(packed.train_dirs[0], warmed, columns=TRAINING_COLUMNS)  # SQLite pages count too
        if before.entries:
            break
    assert 0 < before.entries < row_groups
    packed.cache_dir = str(warmed.directory)
    inputs = SimpleNamespace(**{**vars(packed), "cache_size_limit_bytes": quota, "cache_policy": "stop_admitting"})
    config = _config(max_epochs=1)
    batches = EpochBatches(inputs, config, 0, 1, 0, None)
    while batches.next() is not None:
        pass
    batches.close()
    assert batches.stats()["cache_evictions"] == 0
    cache = RowGroupCache(warmed)
    try:
        assert len(cache) == before.entries and cache.volume() <= quota
    finally:
        cache.close()
