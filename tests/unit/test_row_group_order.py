"""Pure order functions: permutation, shards, windows, lockstep, exact and elastic resume."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from training_core.data.order import (
    build_epoch_layout,
    get_shuffle_algorithm,
    permute_row_groups,
    rank_schedule,
    shard_contiguous,
    window_permutation,
)
from training_core.data.order.invariants import check_epoch, rank_batches

sizes_strategy = st.lists(st.integers(0, 40), min_size=1, max_size=10).filter(lambda s: sum(s) > 0)


@settings(max_examples=60, deadline=None)
@given(
    sizes=sizes_strategy,
    seed=st.integers(0, 2**32 - 1),
    epoch=st.integers(0, 5),
    world_size=st.integers(1, 5),
    batch_size=st.integers(1, 9),
    window=st.integers(1, 4),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    resume_after=st.integers(0, 6),
    resume_world=st.integers(1, 6),
    resume_batch=st.integers(1, 9),
)
def test_order_invariants_hold(sizes, seed, epoch, world_size, batch_size, window, drop_last, shuffle,
                               resume_after, resume_world, resume_batch):
    counts = check_epoch(
        sizes, seed=seed, epoch=epoch, world_size=world_size, batch_size=batch_size, window_row_groups=window,
        drop_last=drop_last, shuffle=shuffle, resume_after_batches=resume_after,
        resume_world_size=resume_world, resume_batch_size=resume_batch,
    )
    assert counts["rows"] == sum(sizes)
    assert counts["padded"] < world_size


@settings(max_examples=25, deadline=None)
@given(sizes=sizes_strategy, seed=st.integers(0, 1000), world_size=st.integers(1, 4), batch_size=st.integers(1, 8))
def test_exact_resume_matches_uninterrupted_batches(sizes, seed, world_size, batch_size):
    layout = build_epoch_layout(sizes, seed=seed, epoch=0, world_size=world_size, batch_size=batch_size,
                                shuffle=True, window_row_groups=2, drop_last=False)
    for rank in range(world_size):
        full = rank_batches(layout, np.array(sizes), 0, world_size, rank, batch_size)
        schedule = rank_schedule(0, layout.total_positions, world_size, rank, batch_size, False)
        for k in range(len(full)):
            resumed = rank_batches(layout, np.array(sizes), schedule.consumed_after(k), world_size, rank, batch_size)
            assert len(resumed) == len(full) - k
            assert all(np.array_equal(a, b) for a, b in zip(resumed, full[k:]))


def test_drop_last_never_repeats_and_ranks_are_disjoint():
    sizes = [7, 0, 13, 5, 21]
    layout = build_epoch_layout(sizes, seed=3, epoch=1, world_size=3, batch_size=4, shuffle=True,
                                window_row_groups=2, drop_last=True)
    per_rank = [np.concatenate(rank_batches(layout, np.array(sizes), 0, 3, r, 4)) for r in range(3)]
    assert {len(p) for p in per_rank} == {len(per_rank[0])}
    combined = np.concatenate(per_rank)
    assert len(np.unique(combined)) == len(combined) == 3 * (46 // 3 // 4) * 4


def test_pad_policy_repeats_the_start_of_the_epoch_sequence():
    shards = shard_contiguous(np.array([5, 5]), np.array([1, 0]), 3, drop_last=False)
    lengths = [int((s[:, 2] - s[:, 1]).sum()) for s in shards]
    assert lengths == [4, 4, 4]
    assert shards[2][-1].tolist() == [1, 0, 2]  # wrapped: first two rows of the first visited group


def test_each_epoch_reorders_and_seed_matters():
    orders = {tuple(permute_row_groups(50, seed=7, epoch=e)) for e in range(5)}
    assert len(orders) == 5
    assert not np.array_equal(permute_row_groups(50, 7, 0), permute_row_groups(50, 8, 0))
    assert np.array_equal(permute_row_groups(50, 7, 0, shuffle=False), np.arange(50))


def test_order_ignores_and_preserves_global_rng():
    np.random.seed(1)
    state = np.random.get_state()[1].copy()
    first = build_epoch_layout([9, 4, 11], seed=0, epoch=0, world_size=2, batch_size=3, shuffle=True,
                               window_row_groups=2, drop_last=False)
    assert np.array_equal(np.random.get_state()[1], state)
    np.random.seed(99)
    second = build_epoch_layout([9, 4, 11], seed=0, epoch=0, world_size=2, batch_size=3, shuffle=True,
                                window_row_groups=2, drop_last=False)
    assert all(np.array_equal(a, b) for s1, s2 in zip(first.windows, second.windows) for a, b in zip(s1, s2))
    assert np.array_equal(first.window_order(1, 0), second.window_order(1, 0))


def test_window_permutation_is_a_permutation_and_dispatcher_names():
    perm = window_permutation(1000, 1, 2, 4, 3, 5)
    assert sorted(perm.tolist()) == list(range(1000))
    assert not np.array_equal(perm, np.arange(1000))
    assert np.array_equal(get_shuffle_algorithm("none")(5, 0, 0, 1, 0, 0), np.arange(5))
    with pytest.raises(ValueError, match="unknown shuffle algorithm"):
        get_shuffle_algorithm("bogus")


def test_fewer_samples_than_ranks_keeps_lockstep_with_a_repeat():
    schedules = [rank_schedule(10, 12, 4, r, 8, drop_last=False) for r in range(4)]
    assert {s.num_batches for s in schedules} == {1}
    ranges = [s.batch_range(0) for s in schedules]
    assert ranges[0] == (10, 11) and ranges[1] == (11, 12)
    assert all(stop - start == 1 for start, stop in ranges)
    assert rank_schedule(10, 12, 4, 0, 8, drop_last=True).num_batches == 0


# Pinned: the batches a run trains on, in order. A change here changes every recorded run's batches:
# `tessera reproduce` and resuming a checkpoint would no longer give the recorded loss curve, while
# every invariant above still holds (found by seeding the permutation with seed + 1: nothing else
# failed). Update these only for a deliberate order change, saying so in the commit.
PINNED_FIRST_BATCHES = {
    (0, 0): [[41, 40, 33, 42], [32, 39, 36, 38], [34, 37, 31, 35]],
    (0, 1): [[55, 54, 59, 56], [10, 52, 53, 57], [58, 11, 48, 46]],
    (1, 0): [[43, 41, 39, 36], [49, 47, 44, 48], [42, 51, 45, 46]],
    (1, 1): [[18, 59, 21, 22], [23, 55, 20, 19], [56, 57, 58, 54]],
}


@pytest.mark.parametrize(("seed", "rank"), PINNED_FIRST_BATCHES)
def test_the_reader_yields_the_pinned_batches_for_each_seed_and_rank(tmp_path, seed, rank):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from training_core.data import RowGroupReader

    ids = np.arange(60)
    pq.write_table(pa.table({"id": ids[:36]}), tmp_path / "part-0.parquet", row_group_size=6)
    pq.write_table(pa.table({"id": ids[36:]}), tmp_path / "part-1.parquet", row_group_size=8)
    reader = RowGroupReader([str(tmp_path)], columns=["id"], batch_size=4, seed=seed, world_size=2, rank=rank,
                            shuffle_buffer_row_groups=2, drop_last=True)
    try:
        batches = [batch["id"].tolist() for batch in reader]
    finally:
        reader.close()
    assert batches[:3] == PINNED_FIRST_BATCHES[seed, rank] and len(batches) == 7
