"""Source records: messages name the file actually read (the partition substituted into the
source template), and a null field is told apart from a missing one."""

from __future__ import annotations

import json

import dagster as dg
import pytest

from training_core.data.sources import read_records
from training_core.errors import EmptyPartitionError, SourceDataError


def _raw_examples(source: str, home, day: str = "2026-11-01"):
    from assets.data_assets import RawExamplesConfig, raw_examples
    from resources import TesseraStorage

    # Closed here: an ephemeral instance left to the garbage collector closes its SQLite
    # connections at a random later moment, with tracebacks (and, on Python 3.11.7, a SystemError).
    with dg.build_asset_context(partition_key=day) as context:
        return raw_examples(context, config=RawExamplesConfig(source=source), storage=TesseraStorage(home=str(home)))


def test_an_empty_partition_file_is_named_with_the_partition_substituted(tmp_path):
    (tmp_path / "jsonl").mkdir()
    (tmp_path / "jsonl" / "2026-11-01.jsonl").write_text("\n")
    with pytest.raises(EmptyPartitionError) as caught:
        _raw_examples(str(tmp_path / "jsonl" / "{partition}.jsonl"), tmp_path / "home")
    assert str(caught.value) == f"partition 2026-11-01: source {tmp_path / 'jsonl' / '2026-11-01.jsonl'} has no records"
    assert not (tmp_path / "home" / "datasets" / "raw" / "2026-11-01").exists()  # refused before any writing


def test_the_records_log_line_names_the_folder_actually_read(tmp_path, capfd):
    day_folder = tmp_path / "data" / "2026-11-02"
    day_folder.mkdir(parents=True)
    (day_folder / "a.jsonl").write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
    capfd.readouterr()
    output = _raw_examples(str(tmp_path / "data" / "{partition}"), tmp_path / "home", day="2026-11-02")
    log = capfd.readouterr().err  # Dagster's log
    assert output.value.records == 1
    assert f"partition 2026-11-02: 1 records from {day_folder}" in log
    assert "{partition}" not in log


def test_a_null_field_is_told_apart_from_a_missing_one(tmp_path):
    path = tmp_path / "a.jsonl"
    good = json.dumps({"prompt": "p", "response": "r"}) + "\n"
    path.write_text(good + json.dumps({"prompt": "p", "response": None}) + "\n")
    with pytest.raises(SourceDataError, match=r"^line 2 of .*a\.jsonl: field 'response' is null$"):
        read_records(path)
    path.write_text(good * 2 + json.dumps({"prompt": None, "response": "r"}) + "\n")
    with pytest.raises(SourceDataError, match=r"^line 3 of .*a\.jsonl: field 'prompt' is null$"):
        read_records(path)
    path.write_text(good + json.dumps({"prompt": "p"}) + "\n")
    with pytest.raises(SourceDataError, match=r"^line 2 of .*a\.jsonl: missing field 'response'$"):
        read_records(path)
    array = tmp_path / "records.json"
    array.write_text(json.dumps([{"prompt": "a", "response": "b"}, {"prompt": None, "response": "d"}]))
    with pytest.raises(SourceDataError, match=r"^item 1 \(0-based\) of the JSON array in .*records\.json: field 'prompt' is null$"):
        read_records(array)


def test_parquet_errors_say_rows_are_0_based_like_json_array_items(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["x", "y"], "response": ["z", None]}), tmp_path / "b.parquet")
    with pytest.raises(SourceDataError, match=r"^row 1 \(0-based\) of .*b\.parquet: field 'response' is null$"):
        read_records(tmp_path / "b.parquet")
    pq.write_table(pa.table({"prompt": ["x", " "], "response": ["z", "w"]}), tmp_path / "b.parquet")
    with pytest.raises(SourceDataError, match=r"^row 1 \(0-based\) of .*b\.parquet: field 'prompt' must be a non-empty string"):
        read_records(tmp_path / "b.parquet")
