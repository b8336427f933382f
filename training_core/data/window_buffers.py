"""Reused memory for shuffle windows, handed out without ever aliasing a live batch.

A window of 8 row groups is ~16 MB here; a fresh one per window made the kernel fault in (and
zero) new pages for every window of a fresh process. :class:`WindowBuffers` keeps the memory of
windows that nobody uses any more and hands it out again.

"Nobody uses it" is decided by Python's own reference counting, not by the producer's bookkeeping:
every window array is a view of a fresh ``pyarrow.Buffer`` *lease* over the pooled memory, and every
array cut from it (the batches handed to the consumer, a ``torch.from_numpy`` of them, …) keeps that
lease alive. The memory returns to the pool only when the lease dies, i.e. when the last such array
is gone, exactly when ``np.empty`` memory would have been freed. A batch the consumer keeps is
therefore never overwritten by a later window.
"""
from __future__ import annotations

import threading
import weakref
from typing import Sequence

import numpy as np
import pyarrow as pa


class WindowBuffers:
    """``empty(shape, dtype)`` like ``np.empty``, but reusing the memory of dead windows.

    At most ``max_free`` unused blocks are kept (the rest are freed as usual), so the pool adds at
    most that many blocks to the memory the reader already holds. Object columns are not pooled.
    A block is reused for a request of at least half its size, so a small column never pins a big
    block. Thread-safe: a lease may die on any thread (the consumer's, usually).
    """

    def __init__(self, max_free: int = 6) -> None:
        self.max_free = max_free
        self.reused = 0  # requests served from the pool
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._closed = False

    def empty(self, shape: Sequence[int] | int, dtype: np.dtype | type) -> np.ndarray:
        dtype = np.dtype(dtype)
        if dtype.hasobject:
            return np.empty(shape, dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = max(count * dtype.itemsize, 1)
        block = self._take(nbytes)
        if block is None:
            block = np.empty(nbytes, dtype=np.uint8)
        lease = pa.py_buffer(block)
        finalizer = weakref.finalize(lease, self._give_back, block)
        finalizer.atexit = False
        return np.frombuffer(lease, dtype, count).reshape(shape)

    def _take(self, nbytes: int) -> np.ndarray | None:
        with self._lock:
            fitting = [i for i, block in enumerate(self._free) if nbytes <= block.nbytes <= 2 * nbytes]
            if not fitting:
                return None
            self.reused += 1
            return self._free.pop(min(fitting, key=lambda i: self._free[i].nbytes))

    def _give_back(self, block: np.ndarray) -> None:
        with self._lock:
            if not self._closed and len(self._free) < self.max_free:
                self._free.append(block)

    def close(self) -> None:
        """Free the unused blocks; blocks still leased are freed when their arrays die."""
        with self._lock:
            self._closed = True
            self._free.clear()
