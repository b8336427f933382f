"""Source files as other tools write them: a CSV with Windows line ends (Excel's), a .json array
after blank lines, and a day of more records than the origins are saved in at once. Each is read
whole, and a bad record is named by the line a text editor shows it on."""

from __future__ import annotations

import json

import pytest

from training_core.data.sources import RecordOrigins, iter_records
from training_core.errors import SourceDataError


def test_a_csv_with_windows_line_ends_names_a_bad_row_by_its_line(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes(b"prompt,response\r\nx,y\r\nz,w\r\nbad,\r\n")
    with pytest.raises(SourceDataError, match=r"^line 4 of .*excel\.csv: field 'response' must be a non-empty"):
        list(iter_records(path))


def test_a_json_array_after_blank_lines_is_read_as_an_array(tmp_path):
    path = tmp_path / "day.json"
    path.write_text('\n  \n[{"prompt": "a", "response": "b"},\n {"prompt": "c", "response": "d"}]\n')
    origins = RecordOrigins()
    assert list(iter_records(path, origins)) == [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}]
    assert origins.describe(1) == f"item 1 (0-based) of {path}"


def test_the_origins_of_a_day_of_many_records_are_saved_and_read_back_whole(tmp_path):
    count = 10_000  # more than the origins are written in at once
    path = tmp_path / "day.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{n}", "response": "r"}) + "\n" for n in range(count)))
    origins = RecordOrigins()
    assert sum(1 for _ in iter_records(path, origins)) == count
    origins.save(tmp_path / "origins.json")
    # JSON as any tool reads it, not only as RecordOrigins.load parses it (pair by pair)
    assert len(json.loads((tmp_path / "origins.json").read_text())["positions"]) == count
    loaded = RecordOrigins.load(tmp_path / "origins.json")
    assert loaded is not None and len(loaded) == count
    assert [loaded.describe(i) for i in (0, count - 1)] == [f"line 1 of {path}", f"line {count} of {path}"]
