"""A simulated slow object store for the loader benchmark: local files read through a link of fixed
bandwidth shared by every reader, plus a fixed latency per request (what a remote bucket costs)."""
from __future__ import annotations

import threading
import time
from typing import Any


class _SharedLink:
    """A store link of fixed bandwidth shared by all readers, plus a fixed latency per request."""

    def __init__(self, bandwidth_bytes_per_s: float, latency_s: float) -> None:
        self.bandwidth, self.latency = bandwidth_bytes_per_s, latency_s
        self._lock, self._free_at = threading.Lock(), 0.0

    def transfer(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + nbytes / self.bandwidth
            done = self._free_at
        time.sleep(max(done - time.monotonic(), 0.0) + self.latency)


def slow_filesystem(bandwidth_bytes_per_s: float, latency_s: float):
    from fsspec.implementations.local import LocalFileSystem

    link = _SharedLink(bandwidth_bytes_per_s, latency_s)

    class _SlowFile:
        def __init__(self, inner) -> None:
            self._inner = inner

        def read(self, size: int = -1) -> bytes:
            data = self._inner.read(size)
            link.transfer(len(data))
            return data

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    class SlowLocalFileSystem(LocalFileSystem):
        def _open(self, path, mode="rb", **kwargs):
            return _SlowFile(super()._open(path, mode, **kwargs))

    return SlowLocalFileSystem(skip_instance_cache=True)
