"""Reader telemetry: throughput, cache behaviour and how long the consumer waited for data."""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ReaderStats:
    """Snapshot of one reader's counters since it was created.

    ``consumer_wait_s`` is time spent inside ``next(iterator)`` waiting for a batch;
    ``stall_fraction`` is that time over the wall time since the first batch was requested.
    """

    rows: int
    bytes: int
    batches: int
    elapsed_s: float
    rows_per_s: float
    bytes_per_s: float
    cache_hits: int
    cache_misses: int
    cache_evictions: int
    cache_corruptions: int
    cache_rejected: int
    cache_dropped: int  # not stored because the background writer's queue was full
    cache_write_errors: int  # not stored because the write failed (disk full, ...): read from Parquet again
    consumer_wait_s: float
    stall_fraction: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class StatsRecorder:
    """Mutable counters behind :class:`ReaderStats` (updated by the consumer thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rows = 0
        self.bytes = 0
        self.batches = 0
        self.wait_s = 0.0
        self._started: float | None = None
        self._last: float | None = None

    def start(self) -> None:
        with self._lock:
            if self._started is None:
                self._started = time.perf_counter()

    def record_batch(self, rows: int, nbytes: int, wait_s: float) -> None:
        with self._lock:
            self.rows += rows
            self.bytes += nbytes
            self.batches += 1
            self.wait_s += wait_s
            self._last = time.perf_counter()

    def record_wait(self, wait_s: float) -> None:
        with self._lock:
            self.wait_s += wait_s

    def snapshot(self, cache_counters: Any | None) -> ReaderStats:
        with self._lock:
            now = time.perf_counter()
            elapsed = 0.0 if self._started is None else now - self._started
            rate = (lambda value: value / elapsed if elapsed > 0 else 0.0)
            get = (lambda name: int(getattr(cache_counters, name, 0)) if cache_counters is not None else 0)
            return ReaderStats(
                rows=self.rows,
                bytes=self.bytes,
                batches=self.batches,
                elapsed_s=elapsed,
                rows_per_s=rate(self.rows),
                bytes_per_s=rate(self.bytes),
                cache_hits=get("hits"),
                cache_misses=get("misses"),
                cache_evictions=get("evictions"),
                cache_corruptions=get("corruptions"),
                cache_rejected=get("rejected"),
                cache_dropped=get("dropped"),
                cache_write_errors=get("write_errors"),
                consumer_wait_s=self.wait_s,
                stall_fraction=self.wait_s / elapsed if elapsed > 0 else 0.0,
            )
