"""Work off the consumer thread: a bounded decode pool, row-group loading and window assembly.

Threads are daemons named ``tessera-reader-<id>-...``; every wait has a timeout and checks a stop
event, so closing a reader (or dropping its iterator) never hangs. Results are consumed in
submission order, so thread timing can never change the sample order.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa

from .arrow_numpy import table_to_numpy
from .cache import (
    BufferPool,
    CacheConfig,
    CacheStorageError,
    CacheWarmReport,
    RowGroupCache,
    cache_key,
    cache_version,
)
from .cache_payload import narrow_columns
from .cache_writer import CacheWriter
from .footer_statistics import current_value_ranges
from .parquet_files import (
    DatasetIndex,
    ReadTimeoutError,
    RowGroupReadError,
    RowGroupRef,
    SourceError,
    check_read_columns,
    index_dataset,
    read_row_group_table,
)

logger = logging.getLogger(__name__)

THREAD_PREFIX = "tessera-reader"
_POLL_S = 0.05
_MAX_OPEN_FILES_PER_THREAD = 32


class ReaderClosedError(RuntimeError):
    """The reader was closed while work was pending."""


class TransformError(RowGroupReadError):
    """The user ``transform`` raised, returned columns of the wrong length, or returned other
    columns for one row group than for another."""


_running = threading.local()  # .task: the Task this thread runs, so that its work can name its phase


def note_phase(phase: str) -> None:
    """Record what the task running on this thread is doing (named if it times out)."""
    task = getattr(_running, "task", None)
    if task is not None:
        task.phase = phase


class Task:
    """One unit of work and its outcome; waiting on it enforces the read timeout."""

    __slots__ = ("fn", "args", "label", "done", "result", "error", "started_at", "phase")

    def __init__(self, fn: Callable[..., Any], args: tuple, label: str) -> None:
        self.fn, self.args, self.label = fn, args, label
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.started_at: float | None = None
        self.phase = "read"

    def run(self) -> None:
        self.started_at = time.monotonic()
        _running.task = self
        try:
            self.result = self.fn(*self.args)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer
            self.error = error
        finally:
            _running.task = None
            self.done.set()

    def cancel(self) -> None:
        self.error = ReaderClosedError(f"{self.label}: reader closed")
        self.done.set()

    def wait(self, timeout_s: float, stop: threading.Event) -> Any:
        while not self.done.is_set():
            started = self.started_at
            budget = _POLL_S if started is None else min(_POLL_S, started + timeout_s - time.monotonic())
            if self.done.wait(max(budget, 0.0)):
                break
            if stop.is_set():
                raise ReaderClosedError(f"{self.label}: reader closed")
            if started is not None and time.monotonic() - started >= timeout_s:
                if self.phase == "transform":  # the read is done: not the storage's fault
                    raise TransformError(
                        f"{self.label}: the transform has not returned read_timeout_s={timeout_s:g}s after the row "
                        f"group's read started (the limit covers read and transform); raise read_timeout_s for a "
                        f"transform this slow"
                    )
                raise ReadTimeoutError(
                    f"{self.label}: no result after read_timeout_s={timeout_s:g}s; the storage may be hanging"
                )
        if self.error is not None:
            # a cache error is raised as it is: wrapped, it read as a fault of the row group's Parquet file
            if isinstance(self.error, (RowGroupReadError, ReaderClosedError, SourceError, CacheStorageError)):
                raise self.error
            raise RowGroupReadError(f"{self.label}: {type(self.error).__name__}: {self.error}") from self.error
        return self.result


class WorkerPool:
    """Fixed daemon threads running :class:`Task` objects in FIFO order."""

    def __init__(self, workers: int, name: str) -> None:
        self._queue: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._work, args=(self._queue, self._stop), name=f"{name}-decode-{i}", daemon=True)
            for i in range(max(1, workers))
        ]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _work(tasks: queue.SimpleQueue, stop: threading.Event) -> None:
        while True:
            task = tasks.get()
            if task is None:
                return
            task.cancel() if stop.is_set() else task.run()

    def submit(self, fn: Callable[..., Any], *args: Any, label: str) -> Task:
        task = Task(fn, args, label)
        if self._stop.is_set():
            task.cancel()
        else:
            self._queue.put(task)
        return task

    def close(self, join_timeout_s: float = 5.0) -> None:
        self._stop.set()
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + join_timeout_s
        for thread in self._threads:
            if thread is threading.current_thread():
                continue  # closed by a finalizer the GC ran on this thread: it ends after its task
            thread.join(max(deadline - time.monotonic(), 0.0))
            if thread.is_alive() and join_timeout_s > 0:
                logger.warning("%s still blocked in storage after close; it exits when the read returns", thread.name)


class RequestWatch:
    """The storage request a listing thread is in, so that ``read_timeout_s`` bounds each request
    (a listing call, a footer read), not the whole listing: one deadline for all of them meant a
    dataset of more than ``read_timeout_s / latency`` files could never be opened. Once the waiter
    gives up it sets ``stop``, and the abandoned listing's next request raises instead of opening
    another file."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.current = ("starting", time.monotonic())  # (request, started at): replaced as one tuple

    def before_request(self, request: str) -> None:
        if self.stop.is_set():
            raise ReaderClosedError(f"{request}: not started: a request timed out and the listing was abandoned")
        self.current = (request, time.monotonic())


def call_with_request_timeout(fn: Callable[[Callable[[str], None]], Any], timeout_s: float, label: str,
                              name: str) -> Any:
    """Run ``fn(before_request)`` in a daemon thread (``fn`` calls ``before_request(what)`` before each
    storage request); raise :class:`ReadTimeoutError` once one request has run ``timeout_s``."""
    watch = RequestWatch()
    pool = WorkerPool(1, name)
    task = pool.submit(fn, watch.before_request, label=label)
    try:
        while not task.done.is_set():
            request, started = watch.current
            left = started + timeout_s - time.monotonic()
            if left <= 0 and not task.done.is_set():
                watch.stop.set()
                raise ReadTimeoutError(f"{label}: {request}: no result after read_timeout_s={timeout_s:g}s (the limit "
                                       f"of each storage request); the storage may be hanging")
            task.done.wait(min(_POLL_S, max(left, 0.0)))
        return task.wait(timeout_s, threading.Event())
    finally:
        pool.close(join_timeout_s=1.0 if task.done.is_set() else 0.0)


def _arrow_allocated(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An array in memory of Arrow's pool (mimalloc): its per-thread heaps reuse freed pages, where
    1 MB ``np.empty`` blocks freed by another thread (the cache writer) made glibc fault in fresh
    pages for every row group (12 000 page faults per cold epoch here)."""
    count = int(np.prod(shape))
    return np.frombuffer(pa.allocate_buffer(max(count * dtype.itemsize, 1)), dtype, count).reshape(shape)


class RowGroupLoader:
    """Cache lookup → read → Arrow→NumPy → transform → cache store, for one row group at a time.

    With a cache, a miss's integer columns are narrowed on the decode thread (range from the footer
    statistics when it has them) and that narrow copy serves both the window and the cache. With a
    ``writer`` the store is handed to the background :class:`CacheWriter` (the decode thread
    moves on at once); with ``buffers`` a cache hit is read into a reused buffer, returned as the
    third item so that the caller can give it back once it has copied the rows out. Without a
    ``writer`` the store runs on the decode thread: with ``fail_on_store_error`` (cache warming,
    whose output is the cache) a failed write raises :class:`CacheStorageError`; otherwise (training
    with ``write_queue_bytes=0``) it is logged and counted in ``write_errors``, as the background
    writer does, and the row group is read from Parquet again next time.
    """

    def __init__(
        self,
        index: DatasetIndex,
        cache: RowGroupCache | None,
        transform: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None,
        transform_version: str,
        read_timeout_s: float,
        max_attempts: int = 3,
        fail_on_store_error: bool = False,
    ) -> None:
        self.index, self.cache, self.transform = index, cache, transform
        self.fail_on_store_error = fail_on_store_error
        self.transform_version, self.read_timeout_s, self.max_attempts = transform_version, read_timeout_s, max_attempts
        self._local = threading.local()
        # the columns of the first row group the transform returned, and which row group that was
        self._transform_columns: tuple[frozenset[str], str] | None = None
        self._transform_columns_lock = threading.Lock()

    def key(self, ref: RowGroupRef) -> str:
        widened = [name for name in self.index.columns if name in self.index.widen_columns]
        return cache_key(ref.file.identity, ref.index, self.index.columns, self.transform_version, widened)

    def locate_cached(self) -> None:
        """Let cache hits skip SQLite (see :meth:`RowGroupCache.locate`)."""
        if self.cache is not None:
            self.cache.locate([self.key(ref) for ref in self.index.row_groups])

    def load(
        self, ref: RowGroupRef, writer: CacheWriter | None = None, buffers: BufferPool | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, np.dtype], np.ndarray | None]:
        """Columns of one row group (possibly narrowed, from the cache), their logical dtypes and the
        read buffer they live in (None unless a cache hit used ``buffers``)."""
        key = self.key(ref)
        if self.cache is not None:
            cached = self.cache.get_pooled(key, ref.describe(), buffers)
            if cached is not None:
                if self.transform is not None:
                    self._check_transform_columns(ref, cached[0])
                return cached
        handles: dict = self._local.__dict__.setdefault("handles", {})
        while len(handles) >= _MAX_OPEN_FILES_PER_THREAD:
            handles.pop(next(iter(handles)))
        deadline = time.monotonic() + self.read_timeout_s
        table = read_row_group_table(
            self.index.filesystem, ref, self.index.columns, handles, self.max_attempts, deadline=deadline
        )
        if table.num_rows != ref.num_rows:
            raise RowGroupReadError(f"{ref.describe()}: footer says {ref.num_rows} rows, read {table.num_rows}")
        check_read_columns(ref, table, self.index)
        arrays = table_to_numpy(table, self.index.widen_columns, ref.describe())
        value_ranges = None  # footer statistics describe the file's values, not a transform's
        if self.transform is not None:
            arrays = self._apply_transform(ref, arrays)
            self._check_transform_columns(ref, arrays)
        elif self.cache is not None and (handle := handles.get(ref.file.path)) is not None:
            value_ranges = current_value_ranges(handle.metadata, ref)
        logical = {name: value.dtype for name, value in arrays.items()}
        if self.cache is None:
            return arrays, logical, None
        # Narrow here, while the decoded values are still in this core's cache, and hand the narrow
        # copy to both the shuffle window (which widens it back, as for a hit) and the cache writer;
        # the Arrow buffers are then freed by the thread that allocated them.
        columns = narrow_columns(arrays, value_ranges, _arrow_allocated)
        del arrays, table
        if writer is not None:
            writer.submit(key, columns, logical)
        elif self.fail_on_store_error:
            self.cache.store(key, columns, logical)
        else:
            self.cache.put_many([(key, columns, logical)])
        return columns, logical, None

    def _apply_transform(self, ref: RowGroupRef, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        note_phase("transform")
        try:
            result = self.transform(arrays)
        except Exception as error:
            raise TransformError(f"{ref.describe()}: transform raised {type(error).__name__}: {error}") from error
        if not isinstance(result, dict):
            raise TransformError(f"{ref.describe()}: transform must return dict[str, ndarray], got {type(result)}")
        bad = {name: len(value) for name, value in result.items() if len(value) != ref.num_rows}
        if bad:
            raise TransformError(f"{ref.describe()}: transform changed the row count ({bad}, expected {ref.num_rows})")
        return {name: np.asarray(value) for name, value in result.items()}

    def _check_transform_columns(self, ref: RowGroupRef, arrays: dict[str, np.ndarray]) -> None:
        """The transform must return the same columns for every row group (columns it adds are kept):
        window assembly takes the first piece's, so a column missing from a later one failed as a bare
        KeyError, and one added only to a later one was silently dropped."""
        names = frozenset(arrays)
        with self._transform_columns_lock:
            if self._transform_columns is None:
                self._transform_columns = (names, ref.describe())
            expected, first = self._transform_columns
        if names != expected:
            raise TransformError(f"{ref.describe()}: columns {sorted(names)} differ from {first}'s {sorted(expected)} "
                                 f"(missing {sorted(expected - names)}, extra {sorted(names - expected)}); a transform "
                                 f"must return the same columns for every row group")

    def load_piece(
        self, ref: RowGroupRef, start: int, stop: int, writer: CacheWriter | None = None,
        buffers: BufferPool | None = None,
    ) -> tuple[dict[str, np.ndarray], dict, np.ndarray | None]:
        arrays, dtypes, buffer = self.load(ref, writer, buffers)
        if start == 0 and stop == ref.num_rows:
            return arrays, dtypes, buffer
        return {name: value[start:stop] for name, value in arrays.items()}, dtypes, buffer


def _column_template(
    pieces: Sequence[np.ndarray], dtypes: Sequence[np.dtype], rows: int, empty: Callable[..., np.ndarray]
) -> np.ndarray:
    """Allocate the output for stacking ``pieces``: dense (logical dtype) when they agree, else object."""
    dense = all(p.dtype != object for p in pieces) and len({p.shape[1:] for p in pieces}) == 1
    if dense and pieces[0].ndim <= 2:
        return empty((rows, *pieces[0].shape[1:]), np.result_type(*dtypes))
    return np.empty(rows, dtype=object)


def _as_rows(piece: np.ndarray, dtype: np.dtype, target: np.ndarray) -> np.ndarray:
    # a 2-D object piece (a list-of-strings row group whose lists share one length) needs rows too
    if target.dtype != object or (piece.dtype == object and piece.ndim == 1):
        return piece
    # Always a copy: the rows become views of it, and ``piece`` may live in a pooled cache-read
    # buffer that is released (and reused by the next hit) once the window is assembled.
    piece = piece.astype(dtype, copy=True)
    rows = np.empty(len(piece), dtype=object)
    for i, row in enumerate(piece):
        rows[i] = row
    return rows


def inverse_permutation(order: np.ndarray) -> np.ndarray:
    inverse = np.empty(len(order), dtype=np.int64)
    inverse[order] = np.arange(len(order), dtype=np.int64)
    return inverse


def assemble_window(
    parts: Sequence[dict[str, np.ndarray]], inverse: np.ndarray, dtypes: Sequence[dict] | None = None,
    empty: Callable[..., np.ndarray] = np.empty,
) -> dict[str, np.ndarray]:
    """Concatenate pieces and apply the window permutation in one scatter per piece.

    ``out[j] = concatenated[order[j]]`` is written as ``out[inverse[rows of piece]] = piece``
    (``inverse`` = inverse of ``order``): a vectorized scatter copies each row once, faster than
    concatenate + take, and widens narrowed cache columns back to their logical dtype (``dtypes``).
    Dense outputs come from ``empty(shape, dtype)`` (the reader passes :class:`WindowBuffers`).
    """
    rows = len(inverse)
    out = {}
    for name in parts[0]:
        pieces = [part[name] for part in parts]
        logical = [d[name] for d in dtypes] if dtypes is not None else [p.dtype for p in pieces]
        target = _column_template(pieces, logical, rows, empty)
        offset = 0
        for piece, dtype in zip(pieces, logical):
            target[inverse[offset : offset + len(piece)]] = _as_rows(piece, dtype, target)
            offset += len(piece)
        out[name] = target
    return out


class GatheredWindow:
    """A shuffled window whose rows are gathered slice by slice from its pieces.

    Same rows as :func:`assemble_window` (``rows(lo, hi) == assemble_window(...)[lo:hi]``) but
    without first copying the whole window: the first batch of a pipeline is ready as soon as the
    window's pieces are, instead of after a window-sized scatter into fresh memory. Each slice costs
    a few NumPy calls per piece, so only a pipeline's first window is served this way.
    """

    def __init__(self, parts: Sequence[dict[str, np.ndarray]], dtypes: Sequence[dict], lengths: Sequence[int],
                 order: np.ndarray) -> None:
        self.parts, self.dtypes, self.order = parts, dtypes, order
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def rows(self, lo: int, hi: int) -> dict[str, np.ndarray]:
        wanted = self.order[lo:hi]
        piece_of = np.searchsorted(self.offsets, wanted, side="right") - 1
        picked, positions = [], []
        for k, part in enumerate(self.parts):
            where = np.flatnonzero(piece_of == k)
            rows = wanted[where] - self.offsets[k]
            picked.append({name: column[rows] for name, column in part.items()})
            positions.append(where)
        return assemble_window(picked, np.concatenate(positions), self.dtypes)


def finish_batch(parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Join segment slices into one batch; a ragged column whose rows agree in length becomes 2-D."""
    if len(parts) == 1:
        batch = dict(parts[0])
    else:
        rows = sum(len(next(iter(part.values()))) for part in parts)
        batch = assemble_window(parts, np.arange(rows, dtype=np.int64))  # identity: plain concatenation
    for name, column in batch.items():
        if column.dtype == object and len(column) and isinstance(column[0], np.ndarray):
            first = column[0]
            if all(isinstance(r, np.ndarray) and r.shape == first.shape and r.dtype == first.dtype for r in column):
                batch[name] = np.stack(list(column))
    return batch


def load_all_row_groups(
    source: Any,
    config: CacheConfig,
    columns: Sequence[str] | None,
    workers: int,
    dataset_digest: str | None,
    filesystem: Any | None,
    read_timeout_s: float,
    transform: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None,
    transform_version: str,
) -> CacheWarmReport:
    """Implementation of :func:`training_core.data.cache.warm_cache`."""
    name = f"{THREAD_PREFIX}-warm-{id(config):x}"
    index = call_with_request_timeout(
        lambda before_request: index_dataset(source, columns, filesystem, before_request), read_timeout_s,
        str(source), name,
    )
    cache = RowGroupCache(config)
    try:  # the cache handle is closed on failure too (a failed read leaves only whole, checksummed entries)
        orphans = cache.remove_orphan_files()
        loader = RowGroupLoader(index, cache, transform, transform_version, read_timeout_s, fail_on_store_error=True)
        pool, stop = WorkerPool(workers, name), threading.Event()
        try:
            window = max(2 * workers, 2)
            refs = list(index.row_groups)
            for begin in range(0, len(refs), window):
                tasks = [pool.submit(loader.load, ref, label=ref.describe()) for ref in refs[begin : begin + window]]
                for task in tasks:
                    task.wait(read_timeout_s, stop)
        finally:
            pool.close()
        counters = cache.counters
        entries, payload_bytes = cache.stored([loader.key(ref) for ref in refs])
        report = CacheWarmReport(
            entries=entries,
            bytes=payload_bytes,
            hits=counters.hits,
            misses=counters.misses,
            evictions=counters.evictions,
            corruptions=counters.corruptions,
            hit_rate=counters.hits / max(counters.hits + counters.misses, 1),
            cache_version=cache_version(dataset_digest or index.digest(), index.columns, transform_version),
            orphan_files_removed=orphans,
        )
    finally:
        cache.close()
    logger.info("warmed row-group cache %s: %s", config.directory, report)
    return report
