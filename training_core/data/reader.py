"""``RowGroupReader``: deterministic, resumable batches from Parquet row groups.

Order comes from :mod:`training_core.data.order` (pure functions); decoding runs in
:mod:`training_core.data.workers`, fed by one epoch's producer thread in
:mod:`training_core.data.epoch_pipeline`; this module wires them, tracks the global position and
implements ``state_dict`` / ``load_state_dict``. See docs/loader.md for the design.
"""
from __future__ import annotations

import itertools
import logging
import time
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from .cache import BufferPool, CacheConfig, RowGroupCache
from .epoch_pipeline import EpochPipeline, PipelineEnd, PipelineFailure
from .order import EpochLayout, build_epoch_layout, rank_schedule
from .order.elastic_positions import RankSchedule
from .parquet_files import DatasetIndex, RowGroupReadError, index_dataset
from .stats import ReaderStats, StatsRecorder
from .window_buffers import WindowBuffers
from .workers import THREAD_PREFIX, RowGroupLoader, call_with_request_timeout

logger = logging.getLogger(__name__)

STATE_FORMAT = 1
_ORDER_KEYS = ("seed", "shuffle", "shuffle_buffer_row_groups", "drop_last")
_reader_ids = itertools.count()


class ReaderStateError(ValueError):
    """A state dict does not fit this reader (other dataset, unknown format)."""


class _Position:
    """Global position: epoch, samples consumed by all ranks, and the epoch's layout."""

    def __init__(self, epoch: int, consumed: int, layout_world_size: int, layout_batch_size: int) -> None:
        self.epoch, self.consumed = epoch, consumed
        self.layout_world_size, self.layout_batch_size = layout_world_size, layout_batch_size


class _EpochIterator:
    """Iterator over the rest of the epoch; closing or dropping it stops every thread."""

    def __init__(self, reader: "RowGroupReader") -> None:
        self._reader = reader
        self._schedule = reader._schedule()
        self._layout = reader._layout()
        self._delivered = 0
        self._pipeline: EpochPipeline | None = None
        if self._schedule.num_batches:
            self._pipeline = EpochPipeline(reader, self._layout, self._schedule)
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
        if isinstance(item, (PipelineEnd, PipelineFailure)):
            self.close()
            reader._stats.record_wait(waited)
            if isinstance(item, PipelineEnd):
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


def _check_arguments(**values: Any) -> None:
    """Integers where the reader needs them (a float batch size used to fail in a worker thread,
    a negative seed inside NumPy's generator, neither naming the argument)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an integer, got {value!r}")
    for name in ("seed", "epoch"):
        if values[name] < 0:
            raise ValueError(f"{name} must be >= 0, got {values[name]}")
    for name in ("world_size", "workers", "prefetch_batches"):
        if values[name] < 1:
            raise ValueError(f"{name} must be >= 1, got {values[name]}")


# Fields of a saved state and the smallest value each may hold (bool: must be a bool).
_STATE_FIELDS = {"epoch": 0, "samples_in_epoch": 0, "layout_world_size": 1, "layout_batch_size": 1, "num_rows": 0,
                 "seed": 0, "shuffle": bool, "shuffle_buffer_row_groups": 1, "drop_last": bool}


def _check_state(state: Any) -> None:
    """A state read back from a checkpoint names its bad field instead of failing as a KeyError or
    a TypeError deep in the order computation (or silently reading a string as an epoch)."""
    if not isinstance(state, dict):
        raise ReaderStateError(f"reader state must be a dict (from state_dict()), got {type(state).__name__}")
    if state.get("format") != STATE_FORMAT:
        return  # named by the format check, with the format it has
    for name, rule in _STATE_FIELDS.items():
        if name not in state:
            raise ReaderStateError(f"reader state has no {name!r}; it has {sorted(state)}")
        value = state[name]
        if rule is bool:
            if not isinstance(value, bool):
                raise ReaderStateError(f"reader state {name}={value!r}: expected true or false")
        elif isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < rule:
            raise ReaderStateError(f"reader state {name}={value!r}: expected an integer >= {rule}")


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
        _check_arguments(batch_size=batch_size, seed=seed, epoch=epoch, rank=rank, world_size=world_size,
                         workers=workers, shuffle_buffer_row_groups=shuffle_buffer_row_groups,
                         prefetch_batches=prefetch_batches)
        if columns is not None and (isinstance(columns, (str, bytes)) or not all(isinstance(c, str) for c in columns)):
            raise TypeError(f"columns must be a list of column names, got {columns!r}")
        if columns is not None and not columns:
            raise ValueError("columns must name at least one column (None reads them all)")
        if columns is not None and len(set(columns)) != len(columns):
            raise ValueError(f"columns names a column twice: {list(columns)}")
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
        self.workers, self.drop_last, self.read_timeout_s = workers, drop_last, read_timeout_s
        self.prefetch_batches = prefetch_batches
        self._row_groups_in_flight = max(2 * shuffle_buffer_row_groups, 2 * self.workers)
        self._id = f"{next(_reader_ids)}"
        # read_timeout_s bounds each listing call and footer read, not all of them together
        self._index: DatasetIndex = call_with_request_timeout(
            lambda before_request: index_dataset(source, columns, filesystem, before_request),
            read_timeout_s,
            str(source),
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
        return self._layout_for(p, {key: getattr(self, key) for key in _ORDER_KEYS})

    def _layout_for(self, p: _Position, order: dict[str, Any]) -> EpochLayout:
        """The layout of position ``p``'s epoch under the order settings ``order`` (cached: one entry)."""
        key = (order["seed"], p.epoch, p.layout_world_size, p.layout_batch_size, order["shuffle"],
               order["shuffle_buffer_row_groups"], order["drop_last"])
        if self._layout_cache is None or self._layout_cache[0] != key:
            layout = build_epoch_layout(
                self._index.row_group_sizes, seed=order["seed"], epoch=p.epoch, world_size=p.layout_world_size,
                batch_size=p.layout_batch_size, shuffle=order["shuffle"],
                window_row_groups=order["shuffle_buffer_row_groups"], drop_last=order["drop_last"],
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
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
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
        return {  # plain Python scalars: NumPy integers (a seed given as np.int64) are not JSON
            "format": STATE_FORMAT, "epoch": int(p.epoch), "samples_in_epoch": int(p.consumed),
            "layout_world_size": int(p.layout_world_size), "layout_batch_size": int(p.layout_batch_size),
            "num_rows": int(self._index.num_rows), "seed": int(self.seed), "shuffle": bool(self.shuffle),
            "shuffle_buffer_row_groups": int(self.shuffle_buffer_row_groups), "drop_last": bool(self.drop_last),
            "row_group_sizes_digest": self._index.row_group_sizes_digest(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (saved by any rank at any world size) at this reader's rank/world."""
        _check_state(state)
        if state.get("format") != STATE_FORMAT:
            raise ReaderStateError(f"unknown reader state format {state.get('format')!r}; expected {STATE_FORMAT}")
        if state["num_rows"] != self._index.num_rows:
            raise ReaderStateError(
                f"state was saved for a dataset of {state['num_rows']} rows; this source has {self._index.num_rows}"
            )
        # optional: states saved before it was added still load (checked by row count only)
        saved_sizes = state.get("row_group_sizes_digest")
        if saved_sizes is not None and saved_sizes != (sizes := self._index.row_group_sizes_digest()):
            raise ReaderStateError(
                f"state was saved for a dataset with other row groups (row_group_sizes_digest {saved_sizes!r}; this "
                f"source's is {sizes}): its order differs, so resuming would repeat some rows and skip others"
            )
        # Everything is checked before anything changes: a rejected state leaves the reader, and
        # an iteration running on it, as they were (closing first ended that iteration silently).
        position = _Position(int(state["epoch"]), int(state["samples_in_epoch"]),
                             int(state["layout_world_size"]), int(state["layout_batch_size"]))
        order = {key: state[key] for key in _ORDER_KEYS}
        if (total := self._layout_for(position, order).total_positions) < position.consumed:
            raise ReaderStateError(f"reader state samples_in_epoch={state['samples_in_epoch']} is past the end of its "
                                   f"epoch ({total} samples at world size {state['layout_world_size']})")
        for key in _ORDER_KEYS:
            if state[key] != getattr(self, key):
                logger.warning("load_state_dict: %s=%r from the state replaces %r", key, state[key], getattr(self, key))
                setattr(self, key, state[key])
        self._close_active()
        self._position = position
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
