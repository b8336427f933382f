"""Final shuffle: rows permuted inside windows of consecutive row-group pieces held in memory."""
from __future__ import annotations

import numpy as np

WINDOW_STREAM = 0x57494E


def split_windows(pieces: np.ndarray, window_row_groups: int) -> list[np.ndarray]:
    """Group a rank's pieces into consecutive windows of at most ``window_row_groups`` pieces."""
    if window_row_groups < 1:
        raise ValueError(f"shuffle_buffer_row_groups must be >= 1, got {window_row_groups}")
    return [pieces[i : i + window_row_groups] for i in range(0, len(pieces), window_row_groups)]


def window_permutation(
    num_rows: int, seed: int, epoch: int, world_size: int, rank: int, window_index: int
) -> np.ndarray:
    """Permutation of one window's rows: ``out[j] = window_rows[perm[j]]``.

    Trade-off: shuffle quality is bounded by the window (``shuffle_buffer_row_groups`` row groups
    resident at once, so memory is bounded whatever the dataset size); rows never travel further
    than one window from their row group's slot in the row-group permutation. The stream is keyed
    by (seed, epoch, layout world size, rank, window) so it is a pure function of the layout.
    """
    rng = np.random.default_rng([seed, epoch, world_size, rank, window_index, WINDOW_STREAM])
    return rng.permutation(num_rows).astype(np.int64)


def identity_permutation(
    num_rows: int, seed: int, epoch: int, world_size: int, rank: int, window_index: int
) -> np.ndarray:
    """No shuffle: rows keep their order (used with ``shuffle=False``). Trade-off: none, no mixing."""
    return np.arange(num_rows, dtype=np.int64)
