"""A day's ingest streams: raw_examples and training_dataset hold a batch of records, not the day.
They held every record as a dict (~625 bytes each: 732 MB at a million small records) and read each
source file whole."""

from __future__ import annotations

import gzip
import json
import tracemalloc

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training_core.data.demo_task import make_record
from training_core.errors import EmptyPartitionError, SourceDataError

DAY = "2026-11-01"


def _write_day(path, count: int, seed: int) -> None:
    """Distinct records of 32 letters (~70 tokens, ~130 bytes a line), so that a few thousand make a
    day whose records outweigh what a batch holds."""
    letters = np.random.default_rng(seed).integers(0, 26, size=(count, 32))
    with path.open("w") as handle:
        for row in letters:
            handle.write(json.dumps(make_record("".join(chr(ord("a") + int(i)) for i in row))) + "\n")


def _ingest_peaks(tmp_path, name: str, count: int, base_model) -> tuple[int, int]:
    """Python heap peaks (bytes, tracemalloc) of raw_examples, then training_dataset and its checks,
    run as Dagster runs them for a day of ``count`` records."""
    from assets.data_assets import RawExamplesConfig, TrainingDatasetConfig, raw_examples, training_dataset
    from resources import TesseraStorage

    source = tmp_path / f"{name}.jsonl"
    _write_day(source, count, seed=count)
    storage = TesseraStorage(home=str(tmp_path / name))
    with dg.build_asset_context(partition_key=DAY) as context:
        tracemalloc.start()
        try:
            raw = raw_examples(context, config=RawExamplesConfig(source=str(source)), storage=storage).value
            raw_peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.reset_peak()
            results = list(training_dataset(context, config=TrainingDatasetConfig(seq_len=256, rows_per_file=128, row_group_rows=64), storage=storage,
                                            raw_examples=raw, base_model=base_model))
            dataset_peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert raw.records == count
    assert all(check.passed for check in results[1:]), [check.description for check in results[1:]]
    return raw_peak, dataset_peak


def test_ingest_memory_grows_with_a_batch_not_with_the_day(tmp_path, demo_model):
    _ingest_peaks(tmp_path, "warm", 300, demo_model)  # imports and caches, outside the comparison
    small = _ingest_peaks(tmp_path, "small", 3000, demo_model)
    large = _ingest_peaks(tmp_path, "large", 12000, demo_model)
    # Held as a list of dicts, each added record cost ~850 bytes in raw_examples and ~470 in
    # training_dataset (3.5x and 1.6x the peak here); streamed, ~70 and ~50: a key per distinct
    # record, and buffers (a 1 MB digest read) still filling at the small day's size.
    for stage, small_peak, large_peak in zip(("raw_examples", "training_dataset"), small, large):
        per_record = (large_peak - small_peak) / (12000 - 3000)
        assert per_record < 200, f"{stage}: peak {small_peak:,} -> {large_peak:,} bytes, {per_record:.0f} a record"


@pytest.mark.parametrize("name", ["day.jsonl", "day.csv", "day.jsonl.gz", "day.csv.gz"])
def test_the_first_record_is_yielded_before_the_rest_of_the_file_is_read(tmp_path, name):
    from training_core.data.sources import RecordOrigins, iter_records

    # ~6 MB of text: a reader of the whole file (its bytes, text or lines) allocates that much before
    # its first record; one reading a line at a time, a buffer.
    if ".csv" in name:
        lines = ["prompt,response"] + [f"p{i},{'r' * 50}" for i in range(100_000)] + ['"never closed,r3']
    else:
        lines = [json.dumps({"prompt": f"p{i}", "response": "r" * 50}) for i in range(100_000)] + ["{not json"]
    text = "\n".join(lines) + "\n"
    path = tmp_path / name
    path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    origins = RecordOrigins()
    records = iter_records(path, origins)
    tracemalloc.start()
    try:
        first = next(records)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert first == {"prompt": "p0", "response": "r" * 50}
    assert peak < len(text) / 10, f"{peak:,} bytes allocated for the first record of a {len(text):,}-byte file"
    assert origins.describe(0) == f"line {2 if '.csv' in name else 1} of {path}"
    with pytest.raises(SourceDataError, match=rf"^line {len(lines)} of .*{name}: "):
        list(records)


def test_parquet_is_read_a_batch_at_a_time(tmp_path):
    from training_core.data import sources

    path = tmp_path / "day.parquet"
    rows = sources._PARQUET_BATCH_ROWS * 2
    pq.write_table(pa.table({"prompt": ["p"] * rows, "response": ["r"] * rows, "other": [1] * rows}),
                   path, row_group_size=sources._PARQUET_BATCH_ROWS, compression="none")
    # Damage the last row group's pages: a reader of the whole file fails before its first record.
    last = pq.ParquetFile(path).metadata.row_group(1).column(0)
    with path.open("r+b") as handle:
        handle.seek(last.data_page_offset)
        handle.write(b"\xff" * last.total_compressed_size)
    records = sources.iter_records(path)
    assert next(records) == {"prompt": "p", "response": "r"}
    assert sum(1 for _ in zip(range(sources._PARQUET_BATCH_ROWS - 1), records)) == sources._PARQUET_BATCH_ROWS - 1
    with pytest.raises(SourceDataError, match=r"day\.parquet: not a readable Parquet file"):
        list(records)


def test_a_source_error_part_way_publishes_nothing_and_an_empty_source_writes_nothing(tmp_path):
    from training_core.data.frozen_records import freeze_records
    from training_core.data.sources import RecordOrigins, iter_records

    source = tmp_path / "day.jsonl"
    source.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n" + json.dumps({"prompt": "p"}) + "\n")
    origins = RecordOrigins()
    with pytest.raises(SourceDataError, match="line 2 of .*day.jsonl: missing field 'response'"):
        freeze_records(iter_records(source, origins), origins, tmp_path / "raw")
    assert list((tmp_path / "raw").iterdir()) == []  # the staging folder is gone, nothing published
    source.write_text("\n")
    with pytest.raises(EmptyPartitionError, match=r"^partition x: source s has no records$"):
        freeze_records(iter_records(source), None, tmp_path / "empty", source_label="partition x: source s")
    assert not (tmp_path / "empty").exists()
    source.write_text("".join(json.dumps({"prompt": f"p{i}", "response": "r"}) + "\n" for i in range(3)))
    origins = RecordOrigins()
    frozen = freeze_records(iter_records(source, origins), origins, tmp_path / "raw")
    assert frozen.records == 3 and len(origins) == 3
