"""Background thread that stores decoded row groups in the cache, off the decode path."""
from __future__ import annotations

import logging
import threading
from collections import deque

import numpy as np

from .cache import RowGroupCache

logger = logging.getLogger(__name__)

_BATCH_ENTRIES = 16  # entries stored per put_many call (one SQLite transaction per shard)
_BATCH_BYTES = 32 * 2**20


class CacheWriter:
    """Stores queued row groups with :meth:`RowGroupCache.put_many` (checksum, quota'd insert).

    :meth:`submit` never blocks: when the row groups already waiting hold ``max_pending_bytes`` or
    more, the new one is not stored and counted in ``counters.dropped`` (it is read from Parquet
    again next time). The thread takes everything queued (up to 16 entries / 32 MiB) at once, so
    a writer that fell behind catches up with one transaction per shard instead of one per entry.
    :meth:`close` stores everything still waiting, then ends the thread, so a reader opened
    afterwards finds the entries. Each entry is written completely before its row is committed
    (see :meth:`RowGroupCache.put_many`), so stopping never leaves a torn entry.
    """

    def __init__(self, cache: RowGroupCache, name: str, max_pending_bytes: int) -> None:
        self.cache, self.max_pending_bytes = cache, max_pending_bytes
        self._pending: deque = deque()
        self._pending_bytes = 0
        self._closing = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"{name}-cache-writer", daemon=True)
        self._thread.start()

    def submit(self, key: str, columns: dict[str, np.ndarray], logical: dict[str, np.dtype] | None = None) -> bool:
        """Queue a row group for storing; False (counted in ``dropped``) if the queue is full or closed.

        ``columns`` as they are to be stored (integers already narrowed, see
        :func:`~training_core.data.cache_payload.narrow_columns`), ``logical`` the dtypes they are
        read back as (default: their own)."""
        if logical is None:
            logical = {name: array.dtype for name, array in columns.items()}
        nbytes = sum(array.nbytes for array in columns.values())
        with self._wake:
            if self._closing or (self._pending and self._pending_bytes + nbytes > self.max_pending_bytes):
                self.cache._count(dropped=1)
                return False
            self._pending.append((key, columns, logical, nbytes))
            self._pending_bytes += nbytes
            self._wake.notify()
        return True

    def _next_batch(self) -> list[tuple] | None:
        """The entries at the head of the queue (they stay queued, and counted, until stored)."""
        with self._wake:
            while not self._pending and not self._closing:
                self._wake.wait()
            batch, nbytes = [], 0
            for item in self._pending:
                if batch and (len(batch) == _BATCH_ENTRIES or nbytes + item[3] > _BATCH_BYTES):
                    break
                batch.append(item)
                nbytes += item[3]
            return batch or None

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self.cache.put_many([item[:3] for item in batch])
            except Exception as error:  # noqa: BLE001 - put_many counts its own failures; this is a bug guard
                logger.warning("row-group cache: storing entries failed: %s: %s", type(error).__name__, error)
                self.cache._count(write_errors=len(batch))
            with self._wake:
                for _ in batch:
                    self._pending.popleft()
                self._pending_bytes -= sum(item[3] for item in batch)

    def close(self, timeout_s: float = 60.0) -> None:
        """Store what is waiting, then stop the thread (waits at most ``timeout_s``)."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._thread is threading.current_thread():
            return  # closed by a finalizer the GC ran on this thread: it stores what is queued, then ends
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("%s still storing after %.0fs; it exits when the write returns", self._thread.name,
                           timeout_s)
