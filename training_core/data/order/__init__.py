"""Sample order for an epoch: pure NumPy functions of (seed, epoch, row-group sizes, world size, rank).

Stages, one file each: ``row_group_permutation`` (which row group comes when), ``contiguous_shards``
(equal per-rank spans, drop/pad policy), ``window_shuffle`` (rows mixed inside windows of
row groups), ``elastic_positions`` (one global sequence dealt to ranks batch by batch, which makes
resume at another world size exact). :func:`build_epoch_layout` is the small dispatcher that
combines them; nothing here reads data, threads or global RNG state.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .contiguous_shards import shard_contiguous, stream_length
from .elastic_positions import RankSchedule, positions_to_streams, rank_schedule
from .row_group_permutation import permute_row_groups
from .window_shuffle import identity_permutation, split_windows, window_permutation

PermutationFn = Callable[[int, int, int, int, int, int], np.ndarray]

SHUFFLE_ALGORITHMS: dict[str, PermutationFn] = {
    "window": window_permutation,
    "none": identity_permutation,
}


def get_shuffle_algorithm(name: str) -> PermutationFn:
    """Look up a window-shuffle algorithm by name (``"window"`` or ``"none"``)."""
    try:
        return SHUFFLE_ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown shuffle algorithm {name!r}; choose one of {sorted(SHUFFLE_ALGORITHMS)}") from None


@dataclass(frozen=True)
class Segment:
    """Rows ``[lo, hi)`` of window ``window`` of layout stream ``stream`` (after its shuffle)."""

    stream: int
    window: int
    lo: int
    hi: int


@dataclass(frozen=True)
class EpochLayout:
    """Everything that fixes an epoch's global sample sequence (no per-sample tables)."""

    seed: int
    epoch: int
    world_size: int  # layout world size: the world size when the epoch started
    batch_size: int  # layout batch size
    shuffle: bool
    drop_last: bool
    stream_length: int
    windows: tuple[tuple[np.ndarray, ...], ...]  # [stream][window] -> (k, 3) pieces
    window_starts: tuple[tuple[int, ...], ...]  # [stream] -> row offsets of windows, len = windows + 1

    @property
    def total_positions(self) -> int:
        return self.world_size * self.stream_length

    def window_pieces(self, stream: int, window: int) -> np.ndarray:
        return self.windows[stream][window]

    def window_order(self, stream: int, window: int) -> np.ndarray:
        """Row permutation of one window (``out[j] = concatenated_rows[perm[j]]``)."""
        rows = self.window_starts[stream][window + 1] - self.window_starts[stream][window]
        algorithm = get_shuffle_algorithm("window" if self.shuffle else "none")
        return algorithm(rows, self.seed, self.epoch, self.world_size, stream, window)

    def _locate(self, position: int) -> tuple[int, int]:
        """Scalar twin of :func:`positions_to_streams` (the per-batch fast path)."""
        n, b = self.world_size, self.batch_size
        full_steps, tail = divmod(self.stream_length, b)
        body = full_steps * n * b
        if position < body:
            step, within = divmod(position, n * b)
            stream, offset = divmod(within, b)
            return stream, step * b + offset
        stream, offset = divmod(position - body, max(tail, 1))
        return stream, full_steps * b + offset

    def segments(self, start: int, stop: int) -> list[Segment]:
        """Window slices that hold global positions ``[start, stop)``, in order."""
        first, last = self._locate(start), self._locate(stop - 1)
        if first[0] == last[0] and last[1] - first[1] == stop - 1 - start:
            runs = [(first[0], first[1], last[1] + 1)]
        else:
            streams, offsets = positions_to_streams(
                np.arange(start, stop, dtype=np.int64), self.world_size, self.stream_length, self.batch_size
            )
            breaks = np.flatnonzero((np.diff(streams) != 0) | (np.diff(offsets) != 1)) + 1
            bounds = np.concatenate([[0], breaks, [len(streams)]])
            runs = [
                (int(streams[a]), int(offsets[a]), int(offsets[b - 1]) + 1) for a, b in zip(bounds[:-1], bounds[1:])
            ]
        result = []
        for stream, lo, hi in runs:
            starts = self.window_starts[stream]
            window = bisect.bisect_right(starts, lo) - 1
            while lo < hi:
                upper = min(hi, starts[window + 1])
                result.append(Segment(stream, window, lo - starts[window], upper - starts[window]))
                lo, window = upper, window + 1
        return result


def build_epoch_layout(
    row_group_sizes: np.ndarray,
    *,
    seed: int,
    epoch: int,
    world_size: int,
    batch_size: int,
    shuffle: bool,
    window_row_groups: int,
    drop_last: bool,
) -> EpochLayout:
    """Dispatcher: permutation → contiguous shards → windows, for one epoch and layout world size."""
    sizes = np.asarray(row_group_sizes, dtype=np.int64)
    visit = permute_row_groups(len(sizes), seed, epoch, shuffle)
    shards = shard_contiguous(sizes[visit], visit, world_size, drop_last)
    windows, starts = [], []
    for pieces in shards:
        stream_windows = tuple(split_windows(pieces, window_row_groups))
        rows = [int((w[:, 2] - w[:, 1]).sum()) for w in stream_windows]
        windows.append(stream_windows)
        starts.append(tuple(int(x) for x in np.concatenate([[0], np.cumsum(rows)])))
    return EpochLayout(
        seed=seed,
        epoch=epoch,
        world_size=world_size,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        stream_length=stream_length(int(sizes.sum()), world_size, drop_last),
        windows=tuple(windows),
        window_starts=tuple(starts),
    )


__all__ = [
    "EpochLayout",
    "RankSchedule",
    "SHUFFLE_ALGORITHMS",
    "Segment",
    "build_epoch_layout",
    "get_shuffle_algorithm",
    "identity_permutation",
    "permute_row_groups",
    "positions_to_streams",
    "rank_schedule",
    "shard_contiguous",
    "split_windows",
    "stream_length",
    "window_permutation",
]
