"""Split the epoch's row-group sequence into equal, contiguous per-rank spans of samples."""
from __future__ import annotations

import numpy as np


def stream_length(total_samples: int, world_size: int, drop_last: bool) -> int:
    """Samples per rank: ``floor(T / W)`` when dropping, ``ceil(T / W)`` when padding."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if drop_last:
        return total_samples // world_size
    return -(-total_samples // world_size)


def shard_contiguous(
    sizes_in_visit_order: np.ndarray,
    row_groups_in_visit_order: np.ndarray,
    world_size: int,
    drop_last: bool,
) -> list[np.ndarray]:
    """Cut the concatenated sample sequence into ``world_size`` equal contiguous spans.

    Returns, per rank, an ``(k, 3)`` int64 array of pieces ``(row_group, start_row, stop_row)``.

    Trade-off: spans have exactly equal length, which keeps ranks in lockstep (DDP needs the same
    number of steps everywhere), and each rank reads only ~1/W of the data; the price is that a
    row group on a span boundary is decoded by two ranks. Policy: ``drop_last=False`` pads the last
    span by wrapping around to the start of the epoch's sequence (at most W-1 samples repeated);
    ``drop_last=True`` drops the last ``T mod W`` samples of the sequence (a different set each
    epoch, since the row-group permutation changes).
    """
    sizes = np.asarray(sizes_in_visit_order, dtype=np.int64)
    groups = np.asarray(row_groups_in_visit_order, dtype=np.int64)
    total = int(sizes.sum())
    length = stream_length(total, world_size, drop_last)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    shards = []
    for rank in range(world_size):
        pieces = []
        position, stop = rank * length, (rank + 1) * length
        while position < stop and total > 0:
            wrapped = position % total
            index = int(np.searchsorted(ends, wrapped, side="right"))
            begin = wrapped - int(starts[index])
            take = min(int(sizes[index]) - begin, stop - position)
            pieces.append((int(groups[index]), begin, begin + take))
            position += take
        shards.append(np.asarray(pieces, dtype=np.int64).reshape(-1, 3))
    return shards
