"""The producer side of one epoch on one rank: a thread that schedules row-group reads on the
decode pool ahead of need, assembles shuffled windows and cuts batches into a bounded queue.

It holds no reference to the iterator that consumes it, so dropping the iterator can stop it.
"""
from __future__ import annotations

import functools
import queue
import threading
from collections import deque
from typing import Any, Iterator

import numpy as np

from .cache_writer import CacheWriter
from .order import EpochLayout
from .order.elastic_positions import RankSchedule
from .parquet_files import RowGroupReadError
from .workers import THREAD_PREFIX, GatheredWindow, ReaderClosedError, WorkerPool, assemble_window, finish_batch, inverse_permutation

CHUNK = 16  # batches per queue hand-off


class PipelineEnd:
    pass


class PipelineFailure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class EpochPipeline:
    """Producer thread + decode pool for the rest of one epoch on one rank (no reference to the iterator).

    The producer hands over *lists* of batches (at most ``CHUNK`` each, flushed before it blocks on
    a read; the first lists hold 1, 2, 4, … batches so that the first batch leaves at once), so
    queue hand-offs cost little per batch; the queue holds at most
    ``prefetch_batches / CHUNK`` lists, which bounds memory whatever the dataset size.
    """

    def __init__(self, reader: "RowGroupReader", layout: EpochLayout, schedule: RankSchedule) -> None:
        name = f"{THREAD_PREFIX}-{reader._id}"
        self.stop = threading.Event()
        self.batches: queue.Queue = queue.Queue(maxsize=max(1, reader.prefetch_batches // CHUNK))
        self.ready: deque = deque()
        self.pool = WorkerPool(reader.workers, name)
        self.join_timeout_s = min(1.0, reader.read_timeout_s)  # a read hung in storage cannot be interrupted
        cache = reader._cache
        self.writer = None
        if cache is not None and cache.config.write_queue_bytes > 0:
            self.writer = CacheWriter(cache, name, cache.config.write_queue_bytes)
        buffers = reader._read_buffers
        load = functools.partial(reader._loader.load_piece, writer=self.writer, buffers=buffers)
        args = (layout, schedule, load, buffers, reader._window_buffers, self.pool, self.stop, self.batches,
                reader.read_timeout_s, reader._row_groups_in_flight, reader._index)
        self.thread = threading.Thread(target=_produce, args=args, name=f"{name}-assemble", daemon=True)
        self.thread.start()

    def get(self) -> Any:
        while True:
            try:
                return self.ready.popleft()
            except IndexError:  # empty (``close`` on another thread may empty it at any moment)
                pass
            try:
                item = self.batches.get(timeout=0.1)
            except queue.Empty:
                if self.stop.is_set():
                    raise ReaderClosedError("reader closed (close() from another thread?) while this iteration "
                                            "waited for a batch") from None
                if not self.thread.is_alive() and self.batches.empty():
                    raise RowGroupReadError("reader producer thread exited without a result") from None
                continue
            if not isinstance(item, list):
                return item  # _End or _Failure
            self.ready.extend(item)

    def close(self) -> None:
        self.stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self.batches.get_nowait()
            except queue.Empty:
                break
        self.ready.clear()
        if self.thread is not threading.current_thread():  # the GC may run the finalizer on any thread
            self.thread.join(timeout=5.0)
        self.pool.close(self.join_timeout_s)
        if self.writer is not None:
            # stores what is still queued, so the next reader finds it; the cache handle remembers the
            # value files it wrote, so the next epoch's hits open them directly (no re-scan)
            self.writer.close()


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
        chunk = 1  # grows to CHUNK: the first batch is handed over as soon as it exists
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
                out, chunk = [], min(2 * chunk, CHUNK)
        if out:
            _emit(out, batches, stop)
        _emit(PipelineEnd(), batches, stop)
    except ReaderClosedError:
        return
    except BaseException as error:  # noqa: BLE001 - delivered to the consumer
        try:
            _emit(PipelineFailure(error), batches, stop)
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
