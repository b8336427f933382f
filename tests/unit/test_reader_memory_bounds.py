"""Memory stays bounded when the consumer stops: the producer decodes at most the in-flight limit
plus one shuffle window of row groups ahead, and queues at most ``prefetch_batches`` batches."""
from __future__ import annotations

import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from training_core.data import RowGroupReader
from training_core.data.workers import THREAD_PREFIX

ROW_GROUPS = 60
WINDOW = 2  # row groups per shuffle window: 2000 rows = 40 batches, more than the queue holds


def _queued_batches(pipeline) -> int:
    return len(pipeline.ready) + sum(len(item) for item in list(pipeline.batches.queue) if isinstance(item, list))


def test_a_stalled_consumer_bounds_decoded_row_groups_and_queued_batches(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"x": np.arange(ROW_GROUPS * 1000)}), path, row_group_size=1000)
    decoded = 0
    lock = threading.Lock()

    def count_decodes(columns):
        nonlocal decoded
        with lock:
            decoded += 1
        return columns

    with RowGroupReader(path, batch_size=50, workers=2, shuffle_buffer_row_groups=WINDOW, prefetch_batches=64,
                        transform=count_decodes, transform_version="count") as reader:
        iterator = iter(reader)
        next(iterator)  # then the consumer stalls
        pipeline = iterator._pipeline
        # Steady state: the producer is blocked on a full batch queue and the decode pool has nothing
        # left to start. An unbounded pipeline never blocks: it reaches the end, every row group decoded.
        deadline = time.monotonic() + 20.0
        while not ((pipeline.batches.full() and pipeline.pool._queue.empty()) or decoded == ROW_GROUPS):
            assert time.monotonic() < deadline, f"pipeline never settled: {decoded} row groups decoded"
            time.sleep(0.01)
        queued = _queued_batches(pipeline)
        assert 1 < queued <= reader.prefetch_batches, f"{queued} batches queued for prefetch_batches=64"
        assert decoded <= reader._row_groups_in_flight + WINDOW, f"{decoded} of {ROW_GROUPS} row groups decoded ahead"

        iterator.close()
        ours = f"{THREAD_PREFIX}-{reader._id}-"
        assert [t.name for t in threading.enumerate() if t.name.startswith(ours) and t.is_alive()] == []
