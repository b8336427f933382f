"""Global sample positions: one sequence per epoch, dealt to ranks batch by batch.

The epoch's *layout* (world size N and batch size B at the epoch's start) fixes a global sequence
of ``N * L`` positions: step s holds batch s of rank 0, then batch s of rank 1, ... (the last step
holds each rank's short final batch). Any consumer world size M then takes the remaining positions
in steps of ``M * B'``: rank r gets slice r of each step. With M == N this is exactly "each rank
reads its own span"; with M != N (elastic resume) the remaining positions are still covered once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def positions_to_streams(
    positions: np.ndarray, layout_world_size: int, stream_length: int, layout_batch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Map global positions to ``(layout rank, offset in that rank's stream)``.

    Trade-off: O(1) arithmetic per position, no per-sample table is ever materialized; the cost is
    that after an elastic resume a rank's batches come from several layout streams, so it decodes
    windows of several shards (more I/O) until the epoch ends; the next epoch uses the new layout.
    """
    positions = np.asarray(positions, dtype=np.int64)
    n, b = layout_world_size, layout_batch_size
    full_steps, tail = divmod(stream_length, b)
    body = full_steps * n * b
    in_body = positions < body
    step, within_step = np.divmod(positions, n * b)
    body_rank, body_offset = np.divmod(within_step, b)
    tail_rank, tail_offset = np.divmod(positions - body, max(tail, 1))
    rank = np.where(in_body, body_rank, tail_rank)
    offset = np.where(in_body, step * b + body_offset, full_steps * b + tail_offset)
    return rank, offset


@dataclass(frozen=True)
class RankSchedule:
    """The batches one rank takes from the remaining global positions of an epoch."""

    start: int  # global positions already consumed by all ranks together
    world_size: int
    rank: int
    batch_size: int
    full_steps: int
    last_step_samples: int  # samples in the final short step, 0 if none (or dropped)

    @property
    def num_batches(self) -> int:
        return self.full_steps + (1 if self.last_step_samples else 0)

    def batch_range(self, index: int) -> tuple[int, int]:
        """Global positions ``[start, stop)`` of this rank's batch ``index``."""
        m, b = self.world_size, self.batch_size
        if index < self.full_steps:
            begin = self.start + index * m * b + self.rank * b
            return begin, begin + b
        if index != self.full_steps or not self.last_step_samples:
            raise IndexError(f"batch {index} out of range (rank has {self.num_batches})")
        step_start = self.start + self.full_steps * m * b
        base, extra = divmod(self.last_step_samples, m)
        if base == 0 and self.rank >= extra:
            # Fewer samples than ranks remain: repeat one so every rank still takes a step.
            repeat = step_start + self.rank % self.last_step_samples
            return repeat, repeat + 1
        begin = step_start + self.rank * base + min(self.rank, extra)
        return begin, begin + base + (1 if self.rank < extra else 0)

    def consumed_after(self, batches: int) -> int:
        """Global positions consumed once every rank has taken ``batches`` batches."""
        if batches <= self.full_steps:
            return self.start + batches * self.world_size * self.batch_size
        return self.start + self.full_steps * self.world_size * self.batch_size + self.last_step_samples


def rank_schedule(
    consumed: int, total_positions: int, world_size: int, rank: int, batch_size: int, drop_last: bool
) -> RankSchedule:
    """Deal positions ``[consumed, total)`` to ``world_size`` ranks in lockstep batches.

    Trade-off: every rank gets the same number of batches (lockstep); the final short step is split
    as evenly as possible (``drop_last`` drops it instead). Only if fewer samples than ranks remain
    does a rank repeat one sample, so that no rank skips the step.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    remaining = max(total_positions - consumed, 0)
    full_steps, last = divmod(remaining, world_size * batch_size)
    return RankSchedule(consumed, world_size, rank, batch_size, full_steps, 0 if drop_last else last)
