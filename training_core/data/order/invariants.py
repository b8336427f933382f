"""Reference model and invariant checker for the epoch order (used by tests and debugging).

Computes, without any I/O, which global row ids each rank receives, and checks: same number of
batches on every rank (lockstep), ranks disjoint, every row covered once per epoch, duplicates only
from the documented padding, and exact/elastic resume equal to the uninterrupted run.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from . import EpochLayout, build_epoch_layout, rank_schedule


def window_row_ids(layout: EpochLayout, row_group_offsets: np.ndarray, stream: int, window: int) -> np.ndarray:
    """Global row ids of one window after its shuffle."""
    pieces = layout.window_pieces(stream, window)
    rows = np.concatenate(
        [np.arange(start, stop) + row_group_offsets[group] for group, start, stop in pieces]
        or [np.zeros(0, dtype=np.int64)]
    )
    return rows[layout.window_order(stream, window)]


def rank_batches(
    layout: EpochLayout, sizes: np.ndarray, consumed: int, world_size: int, rank: int, batch_size: int
) -> list[np.ndarray]:
    """Global row ids of each batch rank ``rank`` yields from position ``consumed`` on."""
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    schedule = rank_schedule(consumed, layout.total_positions, world_size, rank, batch_size, layout.drop_last)
    cache: dict[tuple[int, int], np.ndarray] = {}
    batches = []
    for index in range(schedule.num_batches):
        parts = []
        for seg in layout.segments(*schedule.batch_range(index)):
            key = (seg.stream, seg.window)
            if key not in cache:
                cache[key] = window_row_ids(layout, offsets, seg.stream, seg.window)
            parts.append(cache[key][seg.lo : seg.hi])
        batches.append(np.concatenate(parts))
    return batches


def check_epoch(
    sizes, *, seed, epoch, world_size, batch_size, window_row_groups, drop_last, shuffle=True,
    resume_after_batches=None, resume_world_size=None, resume_batch_size=None,
) -> dict[str, int]:
    """Assert the order invariants for one epoch; returns counts (for reporting in tests)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    layout = build_epoch_layout(
        sizes, seed=seed, epoch=epoch, world_size=world_size, batch_size=batch_size,
        shuffle=shuffle, window_row_groups=window_row_groups, drop_last=drop_last,
    )
    per_rank = [rank_batches(layout, sizes, 0, world_size, r, batch_size) for r in range(world_size)]
    counts = {len(batches) for batches in per_rank}
    assert len(counts) == 1, f"ranks not in lockstep: batch counts {counts}"
    seen = Counter(int(i) for batches in per_rank for batch in batches for i in batch)
    padded = world_size * layout.stream_length - total
    if drop_last:
        assert max(seen.values(), default=1) == 1, "a row repeats with drop_last=True"
        assert total - len(seen) < world_size * batch_size + world_size, "dropped too many rows"
    else:
        assert set(seen) == set(range(total)), "rows lost"
        assert sum(seen.values()) - total == padded, "duplicates beyond the documented padding"
    rank_sets = [set(np.concatenate(b).tolist()) if b else set() for b in per_rank]
    if padded == 0:
        for a in range(world_size):
            for b in range(a + 1, world_size):
                assert not rank_sets[a] & rank_sets[b], f"ranks {a} and {b} overlap"
    if resume_after_batches is not None:
        k = min(resume_after_batches, len(per_rank[0]))
        schedule = rank_schedule(0, layout.total_positions, world_size, 0, batch_size, drop_last)
        consumed = schedule.consumed_after(k)
        m = resume_world_size or world_size
        b2 = resume_batch_size or batch_size
        before = [i for r in range(world_size) for batch in per_rank[r][:k] for i in batch.tolist()]
        after = [
            i for r in range(m) for batch in rank_batches(layout, sizes, consumed, m, r, b2) for i in batch.tolist()
        ]
        counts_after = {len(rank_batches(layout, sizes, consumed, m, r, b2)) for r in range(m)}
        assert len(counts_after) == 1, f"resumed ranks not in lockstep: {counts_after}"
        combined = Counter(before + after)
        if not drop_last:
            assert set(combined) == set(range(total)), "rows lost across resume"
            extra = sum(combined.values()) - total
            assert extra <= padded + m - 1, f"{extra} repeats across resume (padding {padded})"
        if m == world_size and b2 == batch_size:
            uninterrupted = [i for r in range(world_size) for batch in per_rank[r][k:] for i in batch.tolist()]
            assert sorted(after) == sorted(uninterrupted), "exact resume differs from the uninterrupted run"
    return {"rows": total, "seen": len(seen), "batches_per_rank": counts.pop(), "padded": padded}
