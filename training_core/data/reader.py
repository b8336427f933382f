"""``RowGroupReader``: deterministic, resumable batches from Parquet row groups.

Order comes from :mod:`training_core.data.order` (pure functions); decoding runs in
:mod:`training_core.data.workers`; this module wires them, tracks the global position and
implements ``state_dict`` / ``load_state_dict``. See docs/loader.md for the design.
"""
from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .cache import BufferPool, CacheConfig, RowGroupCache
from .cache_writer import CacheWriter
from .order import EpochLayout, build_epoch_layout, rank_schedule
from .order.elastic_positions import RankSchedule
from .parquet_files import DatasetIndex, RowGroupReadError, index_dataset
from .stats import ReaderStats, StatsRecorder
from .window_buffers import WindowBuffers
from .workers import (
    THREAD_PREFIX,
    ReaderClosedError,
    RowGroupLoader,
    GatheredWindow,
    WorkerPool,
    assemble_window,
    call_with_timeout,
    finish_batch,
    inverse_permutation,
)

logger = logging.getLogger(__name__)

STATE_FORMAT = 1
_ORDER_KEYS = ("seed", "shuffle", "shuffle_buffer_row_groups", "drop_last")
_reader_ids = itertools.count()
_CHUNK = 16  # batches per queue hand-off


class ReaderStateError(ValueError):
    """A state dict does not fit this reader (other dataset, unknown format)."""


class _Position:
    """Global position: epoch, samples consumed by all ranks, and the epoch's layout."""

    def __init__(self, epoch: int, consumed: int, layout_world_size: int, layout_batch_size: int) -> None:
        self.epoch, self.consumed = epoch, consumed
        self.layout_world_size, self.layout_batch_size = layout_world_size, layout_batch_size


class _End:
    pass


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _EpochPipeline:
    """Producer thread + decode pool for the rest of one epoch on one rank (no reference to the iterator).

    The producer hands over *lists* of batches (at most ``_CHUNK`` each, flushed before it blocks on
    a read; the first lists hold 1, 2, 4, … batches so that the first batch leaves at once), so
    queue hand-offs cost little per batch; the queue holds at most
    ``prefetch_batches / _CHUNK`` lists, which bounds memory whatever the dataset size.
    """

    def __init__(self, reader: "RowGroupReader", layout: EpochLayout, schedule: RankSchedule) -> None:
        name = f"{THREAD_PREFIX}-{reader._id}"
        self.stop = threading.Event()
        self.batches: queue.Queue = queue.Queue(maxsize=max(1, reader.prefetch_batches // _CHUNK))
        self.ready: deque = deque()
        self.pool = WorkerPool(reader.workers, name)
        self.join_timeout_s = min(1.0, reader.read_timeout_s)  # a read hung in storage cannot be interrupted
        cache = reader._cache
        self.writer = None
        if cache is not None and cache.config.write_queue_bytes > 0:
            self.writer = CacheWriter(cache, name, cache.config.write_queue_bytes)
        buffers = reader._read_buffers
        load = functools.partial(reader._loader.load_piece, writer=self.writer, buffers=buffers)
        self.locate_cached = reader._loader.locate_cached
        args = (layout, schedule, load, buffers, reader._window_buffers, self.pool, self.stop, self.batches,
                reader.read_timeout_s, reader._row_groups_in_flight, reader._index)
        self.thread = threading.Thread(target=_produce, args=args, name=f"{name}-assemble", daemon=True)
        self.thread.start()

    def get(self) -> Any:
        while not self.ready:
            try:
                item = self.batches.get(timeout=0.1)
            except queue.Empty:
                if not self.thread.is_alive() and self.batches.empty():
                    raise RowGroupReadError("reader producer thread exited without a result") from None
                continue
            if not isinstance(item, list):
                return item  # _End or _Failure
            self.ready.extend(item)
        return self.ready.popleft()

    def close(self) -> None:
        self.stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self.batches.get_nowait()
            except queue.Empty:
                break
        self.ready.clear()
        self.thread.join(timeout=5.0)
        self.pool.close(self.join_timeout_s)
        if self.writer is not None:
            self.writer.close()  # stores what is still queued, so the next reader finds it
            if self.writer.stored:  # new entries: let the next epoch's hits open their files directly
                self.locate_cached()


def _emit(item: Any, batches: queue.Queue, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            batches.put(item, timeout=0.1)
            return
        except queue.Full:
            continue
    raise ReaderClosedError("reader closed")


def _window_order(layout: EpochLayout, stream: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    order = layout.window_order(stream, window)
    return order, inverse_permutation(order)


def _produce(layout, schedule, load, buffers, window_buffers, pool, stop, batches, timeout_s, in_flight_limit,
             index) -> None:
    """Producer thread: schedule reads ahead, assemble shuffled windows, cut batches."""
    try:
        needs = _window_needs(layout, schedule)
        pending: deque = deque()
        in_flight = 0

        def fill() -> None:
            nonlocal in_flight
            while not pending or in_flight < in_flight_limit:
                need = next(needs, None)
                if need is None:
                    return
                tasks = []
                for group, start, stop_row in layout.window_pieces(*need):
                    ref = index.row_groups[group]
                    tasks.append(pool.submit(load, ref, int(start), int(stop_row), label=ref.describe()))
                order = pool.submit(_window_order, layout, *need, label=f"window {need}")
                pending.append((need, tasks, order))
                in_flight += len(tasks)

        current: dict[int, tuple[int, Any, list]] = {}  # stream -> (window, rows, read buffers held)
        out: list[dict[str, np.ndarray]] = []
        chunk = 1  # grows to _CHUNK: the first batch is handed over as soon as it exists
        for batch_index in range(schedule.num_batches):
            parts = []
            for seg in layout.segments(*schedule.batch_range(batch_index)):
                held = current.get(seg.stream)
                if held is None or held[0] != seg.window:
                    if out:  # hand over what is ready before blocking on reads
                        _emit(out, batches, stop)
                        out = []
                    fill()
                    need, tasks, order = pending.popleft()
                    assert need == (seg.stream, seg.window), (need, seg)
                    pieces = [task.wait(timeout_s, stop) for task in tasks]
                    in_flight -= len(tasks)
                    fill()
                    permutation, inverse = order.wait(timeout_s, stop)
                    if held is not None:
                        for buffer in held[2]:
                            buffers.release(buffer)
                    arrays, dtypes = [p[0] for p in pieces], [p[1] for p in pieces]
                    if not current:  # the pipeline's first window: serve it without a window-sized copy
                        lengths = [int(stop_row - start) for _, start, stop_row in layout.window_pieces(*need)]
                        held = (seg.window, GatheredWindow(arrays, dtypes, lengths, permutation),
                                [p[2] for p in pieces])
                    else:
                        held = (seg.window, assemble_window(arrays, inverse, dtypes, window_buffers.empty), [])
                        for piece in pieces:  # rows are copied out: the read buffers can be reused
                            buffers.release(piece[2])
                    current[seg.stream] = held
                window = held[1]
                if isinstance(window, GatheredWindow):
                    parts.append(window.rows(seg.lo, seg.hi))
                else:
                    parts.append({name: column[seg.lo : seg.hi] for name, column in window.items()})
            out.append(finish_batch(parts))
            if len(out) >= chunk:
                _emit(out, batches, stop)
                out, chunk = [], min(2 * chunk, _CHUNK)
        if out:
            _emit(out, batches, stop)
        _emit(_End(), batches, stop)
    except ReaderClosedError:
        return
    except BaseException as error:  # noqa: BLE001 - delivered to the consumer
        try:
            _emit(_Failure(error), batches, stop)
        except ReaderClosedError:
            return


def _window_needs(layout: EpochLayout, schedule: RankSchedule) -> Iterator[tuple[int, int]]:
    """Windows in the order the producer will first need them (same walk as ``_produce``)."""
    last: dict[int, int] = {}
    for batch_index in range(schedule.num_batches):
        for seg in layout.segments(*schedule.batch_range(batch_index)):
            if last.get(seg.stream) != seg.window:
                last[seg.stream] = seg.window
                yield seg.stream, seg.window


class _EpochIterator:
    """Iterator over the rest of the epoch; closing or dropping it stops every thread."""

    def __init__(self, reader: "RowGroupReader") -> None:
        self._reader = reader
        self._schedule = reader._schedule()
        self._layout = reader._layout()
        self._delivered = 0
        self._pipeline: _EpochPipeline | None = None
        if self._schedule.num_batches:
            self._pipeline = _EpochPipeline(reader, self._layout, self._schedule)
            self._finalizer = weakref.finalize(self, self._pipeline.close)
        else:
            reader._advance_epoch()

    def __iter__(self) -> "_EpochIterator":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._pipeline is None:
            raise StopIteration
        reader = self._reader
        reader._stats.start()
        began = time.perf_counter()
        item = self._pipeline.get()
        waited = time.perf_counter() - began
        if isinstance(item, (_End, _Failure)):
            self.close()
            reader._stats.record_wait(waited)
            if isinstance(item, _End):
                raise StopIteration
            error = item.error
            if isinstance(error, RowGroupReadError):
                raise error
            raise RowGroupReadError(f"reader failed: {type(error).__name__}: {error}") from error
        self._delivered += 1
        if self._delivered == self._schedule.num_batches:
            reader._advance_epoch()
        else:
            reader._position.consumed = self._schedule.consumed_after(self._delivered)
        rows = len(next(iter(item.values()))) if item else 0
        reader._stats.record_batch(rows, sum(column.nbytes for column in item.values()), waited)
        return item

    def close(self) -> None:
        if self._pipeline is not None:
            self._finalizer()
            self._pipeline = None


class RowGroupReader:
    """Batches of NumPy columns from Parquet row groups; order is a pure function of
    (seed, epoch, row-group sizes, world_size, rank), never of threads or cache hits."""

    def __init__(
        self,
        source: Any,
        columns: Sequence[str] | None = None,
        batch_size: int = 256,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
        shuffle_buffer_row_groups: int = 8,
        rank: int = 0,
        world_size: int = 1,
        workers: int = 4,
        cache: CacheConfig | None = None,
        drop_last: bool = False,
        read_timeout_s: float = 60.0,
        *,
        transform: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
        transform_version: str = "none",
        filesystem: Any | None = None,
        prefetch_batches: int = 64,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if shuffle_buffer_row_groups < 1:
            raise ValueError(f"shuffle_buffer_row_groups must be >= 1, got {shuffle_buffer_row_groups}")
        if read_timeout_s <= 0:
            raise ValueError(f"read_timeout_s must be > 0, got {read_timeout_s}")
        if transform is not None and transform_version == "none":
            logger.warning("transform given with transform_version='none': cached rows of another transform may be served")
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.shuffle_buffer_row_groups, self.rank, self.world_size = shuffle_buffer_row_groups, rank, world_size
        self.workers, self.drop_last, self.read_timeout_s = max(1, workers), drop_last, read_timeout_s
        self.prefetch_batches = max(1, prefetch_batches)
        self._row_groups_in_flight = max(2 * shuffle_buffer_row_groups, 2 * self.workers)
        self._id = f"{next(_reader_ids)}"
        self._index: DatasetIndex = call_with_timeout(
            lambda: index_dataset(source, columns, filesystem),
            read_timeout_s,
            f"{source}: listing and footers",
            f"{THREAD_PREFIX}-{self._id}-index",
        )
        self._cache = RowGroupCache(cache) if cache is not None else None
        self._loader = RowGroupLoader(self._index, self._cache, transform, transform_version, read_timeout_s)
        self._loader.locate_cached()
        self._position = _Position(epoch, 0, world_size, batch_size)
        self._stats = StatsRecorder()
        self._active: weakref.ref[_EpochIterator] | None = None  # weak: a dropped iterator must die
        self._layout_cache: tuple[tuple, EpochLayout] | None = None
        # Reused across this reader's epochs: fresh memory costs page faults (docs/loader.md).
        self._read_buffers = BufferPool()
        self._window_buffers = WindowBuffers()

    # -- order -----------------------------------------------------------------------------------
    def _layout(self) -> EpochLayout:
        p = self._position
        key = (self.seed, p.epoch, p.layout_world_size, p.layout_batch_size, self.shuffle,
               self.shuffle_buffer_row_groups, self.drop_last)
        if self._layout_cache is None or self._layout_cache[0] != key:
            layout = build_epoch_layout(
                self._index.row_group_sizes, seed=self.seed, epoch=p.epoch, world_size=p.layout_world_size,
                batch_size=p.layout_batch_size, shuffle=self.shuffle,
                window_row_groups=self.shuffle_buffer_row_groups, drop_last=self.drop_last,
            )
            self._layout_cache = (key, layout)
        return self._layout_cache[1]

    def _schedule(self) -> RankSchedule:
        layout = self._layout()
        return rank_schedule(self._position.consumed, layout.total_positions, self.world_size, self.rank,
                             self.batch_size, self.drop_last)

    def _advance_epoch(self) -> None:
        self._position = _Position(self._position.epoch + 1, 0, self.world_size, self.batch_size)

    # -- public API ------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._position.epoch

    @property
    def num_rows(self) -> int:
        """Rows in the dataset (one epoch, all ranks, before padding / dropping)."""
        return self._index.num_rows

    @property
    def columns(self) -> tuple[str, ...]:
        return self._index.columns

    @property
    def dataset(self) -> DatasetIndex:
        return self._index

    def __len__(self) -> int:
        """Batches this rank still yields in the current epoch."""
        return self._schedule().num_batches

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of ``epoch`` (closes an active iterator)."""
        self._close_active()
        self._position = _Position(epoch, 0, self.world_size, self.batch_size)

    def __iter__(self) -> _EpochIterator:
        """Iterate the rest of the current epoch; when it ends the position moves to the next epoch."""
        self._close_active()
        iterator = _EpochIterator(self)
        self._active = weakref.ref(iterator)
        return iterator

    def state_dict(self) -> dict[str, Any]:
        """Global position as a few JSON scalars; identical on every rank in lockstep."""
        p = self._position
        return {
            "format": STATE_FORMAT, "epoch": p.epoch, "samples_in_epoch": p.consumed,
            "layout_world_size": p.layout_world_size, "layout_batch_size": p.layout_batch_size,
            "num_rows": self._index.num_rows, "seed": self.seed, "shuffle": self.shuffle,
            "shuffle_buffer_row_groups": self.shuffle_buffer_row_groups, "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (saved by any rank at any world size) at this reader's rank/world."""
        if state.get("format") != STATE_FORMAT:
            raise ReaderStateError(f"unknown reader state format {state.get('format')!r}; expected {STATE_FORMAT}")
        if state["num_rows"] != self._index.num_rows:
            raise ReaderStateError(
                f"state was saved for a dataset of {state['num_rows']} rows; this source has {self._index.num_rows}"
            )
        for key in _ORDER_KEYS:
            if state[key] != getattr(self, key):
                logger.warning("load_state_dict: %s=%r from the state replaces %r", key, state[key], getattr(self, key))
                setattr(self, key, state[key])
        self._close_active()
        self._position = _Position(
            int(state["epoch"]), int(state["samples_in_epoch"]),
            int(state["layout_world_size"]), int(state["layout_batch_size"]),
        )
        if self._schedule().num_batches == 0:
            self._advance_epoch()

    @property
    def stats(self) -> ReaderStats:
        return self._stats.snapshot(self._cache.counters if self._cache is not None else None)

    def _close_active(self) -> None:
        iterator = self._active() if self._active is not None else None
        if iterator is not None:
            iterator.close()
        self._active = None

    def close(self) -> None:
        """Stop all threads and release the cache handle; safe to call twice."""
        self._close_active()
        self._window_buffers.close()
        if self._cache is not None:
            self._cache.close()

    def __enter__(self) -> "RowGroupReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
