"""Epoch permutation of row groups: the first, coarse stage of the sample order."""
from __future__ import annotations

import numpy as np

# Tags keep the RNG streams of the different order stages independent of each other.
ROW_GROUP_STREAM = 0x52474F

# NumPy's first seeded ``default_rng`` in a process costs ~4 ms; pay it at import, not on the first batch.
np.random.default_rng([0, 0, ROW_GROUP_STREAM])


def permute_row_groups(num_row_groups: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Return the order in which the epoch visits row groups (indices into canonical order).

    Trade-off: whole row groups move, so reads stay sequential inside a group and the cost is
    O(row groups), independent of the number of rows; rows of one group stay neighbours until the
    window shuffle mixes them with the other groups of their window. Each epoch gets its own stream
    ``default_rng([seed, epoch, ROW_GROUP_STREAM])``; ``shuffle=False`` keeps the canonical order.
    """
    if num_row_groups < 0:
        raise ValueError(f"num_row_groups must be >= 0, got {num_row_groups}")
    if not shuffle:
        return np.arange(num_row_groups, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch, ROW_GROUP_STREAM])
    return rng.permutation(num_row_groups).astype(np.int64)
