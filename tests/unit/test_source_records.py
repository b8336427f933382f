"""Source records (JSONL / JSON / CSV / Parquet, text ones also gzipped; local paths or fsspec URIs):
every bad record is named by file, line or row and field; messages name the file actually read (the
partition substituted into the source template, a URI with its scheme), a null field is told apart
from a missing one, and no file in a source folder is skipped without a word."""

from __future__ import annotations

import gzip
import json

import dagster as dg
import fsspec
import pytest

from training_core.data.dataset_writer import DatasetSpec, write_dataset
from tests.unit.source_support import read_records, read_records_with_origins
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


def test_a_parquet_column_named_twice_is_refused_as_a_csv_header_naming_it_twice_is(tmp_path):
    # Read by name, the last 'prompt' column was taken silently: a dataset built from the wrong text.
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_arrays([pa.array(["question 1", "question 2"]), pa.array(["a", "b"]), pa.array(["sys", "sys"])],
                                 names=["prompt", "response", "prompt"])
    pq.write_table(table, tmp_path / "twice.parquet")
    with pytest.raises(SourceDataError, match=r"twice\.parquet: column\(s\) \['prompt'\] appear more than once in the "
                                              r"schema \['prompt', 'response', 'prompt'\]"):
        read_records(tmp_path / "twice.parquet")


def test_a_csv_of_lone_carriage_returns_is_read_a_row_at_a_time_with_its_line_numbers(tmp_path):
    # Classic Mac OS line ends: csv's line numbers are those of the text read whole.
    (tmp_path / "mac.csv").write_bytes(b"prompt,response\r\"two\rlines\",ok\rp,\r")
    with pytest.raises(SourceDataError, match=r"line 4 of .*mac\.csv: field 'response' must be a non-empty string"):
        read_records(tmp_path / "mac.csv")
    (tmp_path / "mac.csv").write_bytes(b"prompt,response\r\"two\rlines\",ok\rp,r\r")
    assert read_records(tmp_path / "mac.csv") == [{"prompt": "two\rlines", "response": "ok"}, {"prompt": "p", "response": "r"}]


def test_parquet_errors_say_rows_are_0_based_like_json_array_items(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["x", "y"], "response": ["z", None]}), tmp_path / "b.parquet")
    with pytest.raises(SourceDataError, match=r"^row 1 \(0-based\) of .*b\.parquet: field 'response' is null$"):
        read_records(tmp_path / "b.parquet")
    pq.write_table(pa.table({"prompt": ["x", " "], "response": ["z", "w"]}), tmp_path / "b.parquet")
    with pytest.raises(SourceDataError, match=r"^row 1 \(0-based\) of .*b\.parquet: field 'prompt' must be a non-empty string"):
        read_records(tmp_path / "b.parquet")


def test_missing_source_path_names_the_path(tmp_path):
    with pytest.raises(SourceDataError, match="does-not-exist.*does not exist"):
        read_records(tmp_path / "does-not-exist")


def test_unreadable_source_file(tmp_path):
    path = tmp_path / "locked.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(SourceDataError, match="locked.jsonl"):
        read_records(path)


def test_jsonl_line_that_is_not_json_names_file_and_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n{not json\n")
    with pytest.raises(SourceDataError, match=r"line 2 of .*a\.jsonl: not valid JSON"):
        read_records(path)


def test_jsonl_line_missing_a_field(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"prompt": "p", "response": "r"}] * 16 + [{"prompt": "p"}]))
    with pytest.raises(SourceDataError, match=r"line 17 of .*a\.jsonl: missing field 'response'"):
        read_records(path)


def test_csv_and_parquet_sources_read(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.csv").write_text("prompt,response\nhello,world\n")
    pq.write_table(pa.table({"prompt": ["x"], "response": ["y"], "extra": [1]}), tmp_path / "b.parquet")
    (tmp_path / "_SUCCESS").write_text("")
    assert read_records(tmp_path) == [{"prompt": "hello", "response": "world"}, {"prompt": "x", "response": "y"}]


def test_excel_csv_with_a_byte_order_mark_and_a_multi_line_field_reads(tmp_path):
    (tmp_path / "excel.csv").write_bytes(b'\xef\xbb\xbfprompt,response\r\n"two\r\nlines",ok\r\nx,y\r\n')
    assert read_records(tmp_path / "excel.csv") == [{"prompt": "two\r\nlines", "response": "ok"},
                                                    {"prompt": "x", "response": "y"}]


def test_csv_errors_name_the_line_the_row_starts_on(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text('prompt,response\n"spans\nthree\nlines",ok\n\nbad,\n')
    with pytest.raises(SourceDataError, match=r"line 6 of .*a\.csv: field 'response' must be a non-empty string"):
        read_records(path)
    path.write_text('prompt,response\nfine,row\n"never closed,x\n')
    with pytest.raises(SourceDataError, match=r"line 3 of .*a\.csv: malformed CSV \(unexpected end of data\)"):
        read_records(path)
    path.write_text("prompt,response\nsay hi,hello, world\n")  # the response would lose ", world"
    with pytest.raises(SourceDataError, match=r"line 2 of .*a\.csv: 3 cells but the header has 2 columns "
                                              r"\(an unquoted comma\? quote fields that contain commas\)"):
        read_records(path)
    path.write_text("prompt,response\nsay hi,hello,,\n")  # empty trailing cells hold nothing to lose
    assert read_records(path) == [{"prompt": "say hi", "response": "hello"}]
    path.write_text("prompt,response,prompt\nfirst,answer,second\n")  # one prompt would silently win
    with pytest.raises(SourceDataError, match=r"line 1 of .*a\.csv: column\(s\) \['prompt'\] appear more than once"):
        read_records(path)
    path.write_text("question;answer\nq;a\n")
    with pytest.raises(SourceDataError, match=r"header lacks column\(s\) \['prompt', 'response'\]; it has \['question;answer'\]"):
        read_records(path)


@pytest.mark.parametrize("name", ["a.jsonl", "a.csv"])
def test_bytes_that_are_not_utf8_are_named_by_line_and_column(tmp_path, name):
    good = b'{"prompt": "p", "response": "r"}\n' if name.endswith("jsonl") else b"prompt,response\np,r\n"
    bad = b'{"prompt": "caf\xe9", "response": "r"}\n' if name.endswith("jsonl") else b"caf\xe9,r\n"
    before = good + good.splitlines(keepends=True)[-1] * 3
    (tmp_path / name).write_bytes(before + bad)
    line, column = before.count(b"\n") + 1, bad.index(b"\xe9") + 1
    with pytest.raises(SourceDataError, match=rf"line {line} of .*{name}: not UTF-8 \(byte 0xe9 at column {column}\)"):
        read_records(tmp_path / name)


def test_a_json_file_may_hold_one_array_of_records(tmp_path):
    path = tmp_path / "records.json"
    path.write_text(json.dumps([{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}], indent=2))
    assert read_records(path) == [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}]
    path.write_text(json.dumps([{"prompt": "a", "response": "b"}, {"prompt": "c"}], indent=2))
    with pytest.raises(SourceDataError, match=r"item 1 \(0-based\) of the JSON array in .*records\.json: missing field 'response'"):
        read_records(path)
    path.write_text('{\n  "prompt": "a",\n  "response": "b"\n}\n')  # one pretty-printed object
    with pytest.raises(SourceDataError, match=r"line 1 of .*records\.json: not valid JSON .*one object per line, or one JSON array"):
        read_records(path)


def test_suffixes_match_in_any_case_and_an_unknown_one_is_refused(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "UPPER.JSONL").write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
    assert read_records(tmp_path / "data") == [{"prompt": "p", "response": "r"}]
    assert read_records(tmp_path / "data" / "UPPER.JSONL") == [{"prompt": "p", "response": "r"}]
    (tmp_path / "notes.txt").write_text("prompt,response\n")
    with pytest.raises(SourceDataError, match=r"notes\.txt: unsupported file type '\.txt'; expected one of \.jsonl/"):
        read_records(tmp_path / "notes.txt")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert read_records("~/data") == [{"prompt": "p", "response": "r"}]


def test_parquet_row_with_null_field_names_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["x", "y"], "response": ["z", None]}), tmp_path / "b.parquet")
    with pytest.raises(SourceDataError, match=r"row 1 \(0-based\) of .*b\.parquet: field 'response' is null"):
        read_records(tmp_path)


def test_a_blank_source_and_a_broken_unicode_escape_are_named(tmp_path):
    with pytest.raises(SourceDataError, match="source is empty"):
        read_records("")
    path = tmp_path / "a.jsonl"
    path.write_text('{"prompt": "p", "response": "r"}\n{"prompt": "half \\ud83d", "response": "r"}\n')
    with pytest.raises(SourceDataError, match=r"line 2 of .*a\.jsonl: field 'prompt' holds '\\ud83d', which is not a valid Unicode"):
        read_records(path)


def test_files_inside_hidden_or_underscore_folders_are_not_source_data(tmp_path):
    good = json.dumps({"prompt": "p", "response": "r"}) + "\n"
    (tmp_path / "day").mkdir()
    (tmp_path / "day" / "a.jsonl").write_text(good)
    for partial in (".staging-host-1-abc/records.jsonl", "_logs/0/part-0.jsonl", ".staging-2/_temporary/part-0.jsonl"):
        (tmp_path / "day" / partial).parent.mkdir(parents=True)
        (tmp_path / "day" / partial).write_text(good * 3 + '{"prompt": "cut off')
    (tmp_path / "day" / "sub" / "_temporary" / "0").mkdir(parents=True)  # a committed export may leave it, empty
    assert read_records(tmp_path / "day") == [{"prompt": "p", "response": "r"}]


def test_an_export_still_being_written_is_refused_naming_its_temporary_folder(tmp_path):
    """Spark writes each task's part files below `_temporary/` and moves them out on commit: a day
    read before then would train on the parts committed so far."""
    day = tmp_path / "exports" / "2026-11-05"
    (day / "part-00000.jsonl").parent.mkdir(parents=True)
    (day / "part-00000.jsonl").write_text(_jsonl("a"))
    attempt = day / "sub" / "_temporary" / "0" / "_temporary" / "attempt_0001_m_000001_1"
    attempt.mkdir(parents=True)
    (attempt / "part-00001.jsonl").write_text(_jsonl("b", "c"))
    (attempt.parent.parent / "task_0001_m_000000").mkdir()
    (attempt.parent.parent / "task_0001_m_000000" / "part-00002.jsonl").write_text(_jsonl("d"))
    refusal = (rf"^{day}/sub/_temporary holds 2 file\(s\): an export still being written .*"
               r"Wait for the export to commit, or remove _temporary if the job writing it is gone$")
    with pytest.raises(SourceDataError, match=refusal):
        read_records(day)
    with pytest.raises(SourceDataError, match=refusal.replace("^", "^file://", 1)):
        read_records(f"file://{day}")

    memory = fsspec.filesystem("memory")
    uri = f"memory://tessera-{tmp_path.name}/exports/2026-11-05"
    try:
        memory.pipe(f"{uri}/part-00000.jsonl", _jsonl("a").encode())
        memory.pipe(f"{uri}/_temporary/0/_temporary/attempt_1/part-00001.jsonl", _jsonl("b").encode())
        with pytest.raises(SourceDataError, match=rf"^{uri}/_temporary holds 1 file\(s\): an export still being"):
            read_records(uri)
        memory.rm(f"{uri}/_temporary", recursive=True)
        assert [r["prompt"] for r in read_records(uri)] == ["a"]
    finally:
        memory.rm(f"memory://tessera-{tmp_path.name}", recursive=True)


def test_temporary_files_beside_success_are_refused_naming_both_of_their_causes(tmp_path):
    """`_SUCCESS` beside a `_temporary/` holding files does not tell a committed job whose cleanup failed
    from a later job appending to the folder, still writing: refused, saying what to do in each case."""
    day = tmp_path / "exports" / "2026-11-05"
    attempt = day / "_temporary" / "0" / "_temporary" / "attempt_0001_m_000003_1"
    attempt.mkdir(parents=True)
    (attempt / "part-00003.jsonl").write_text(_jsonl("attempt"))
    (day / "part-00000.jsonl").write_text(_jsonl("a", "b"))
    (day / "_SUCCESS").write_text("")
    both = (r" holds 1 file\(s\) beside _SUCCESS: either a committed export's cleanup left them \(remove _temporary\), "
            r"or a later job appending to .* is still writing them \(wait for it to commit\)")
    for source in (str(day), f"file://{day}"):
        with pytest.raises(SourceDataError, match=rf"^{source}/_temporary{both}"):
            read_records(source)
    (day / "_temporary" / "0" / "_temporary" / "attempt_0001_m_000003_1" / "part-00003.jsonl").unlink()
    assert [r["prompt"] for r in read_records(day)] == ["a", "b"]  # an empty _temporary is left behind
    nested = day / "sub" / "_temporary" / "0"  # no _SUCCESS in sub/: still being written
    nested.mkdir(parents=True)
    (nested / "part-00001.jsonl").write_text(_jsonl("c"))
    with pytest.raises(SourceDataError, match=rf"^{day}/sub/_temporary holds 1 file\(s\): an export still being"):
        read_records(day)

    memory = fsspec.filesystem("memory")
    uri = f"memory://tessera-{tmp_path.name}/exports/2026-11-05"
    try:
        memory.pipe(f"{uri}/part-00000.jsonl", _jsonl("a").encode())
        memory.pipe(f"{uri}/_temporary/0/_temporary/attempt_1/part-00001.jsonl", _jsonl("b").encode())
        memory.pipe(f"{uri}/_SUCCESS", b"")
        with pytest.raises(SourceDataError, match=rf"^{uri}/_temporary{both}"):
            read_records(uri)
    finally:
        memory.rm(f"memory://tessera-{tmp_path.name}", recursive=True)


def test_records_keep_where_they_came_from_and_an_overlong_one_names_the_users_file(tmp_path, demo_model):
    from training_core.base_model import load_tokenizer
    from training_core.data.sources import ORIGINS_FILE, RecordOrigins

    source = tmp_path / "source"
    source.mkdir()
    long_prompt = "encode: " + " ".join("abcd" * 30)
    (source / "a.jsonl").write_text("".join(json.dumps({"prompt": f"encode: {w}", "response": "b"}) + "\n\n" for w in "abcde"))
    (source / "b.csv").write_text(f"prompt,response\nencode: z,y\n{long_prompt},x\n")
    (source / "c.json").write_text(json.dumps([{"prompt": "encode: q", "response": "r"}]))
    records, origins = read_records_with_origins(source)
    assert len(records) == 8
    assert [origins.describe(i) for i in (0, 4, 5, 6, 7)] == [
        f"line 1 of {source / 'a.jsonl'}", f"line 9 of {source / 'a.jsonl'}", f"line 2 of {source / 'b.csv'}",
        f"line 3 of {source / 'b.csv'}", f"item 0 (0-based) of {source / 'c.json'}"]

    frozen = tmp_path / "raw"  # what raw_examples publishes: records.jsonl plus the hidden origins
    frozen.mkdir()
    (frozen / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    origins.save(frozen / ORIGINS_FILE)
    assert RecordOrigins.load(frozen / ORIGINS_FILE).describe(6) == origins.describe(6)
    with pytest.raises(SourceDataError, match=rf"p: line 7 of .*records\.jsonl, from line 3 of .*b\.csv \(prompt"):
        write_dataset(records, load_tokenizer(demo_model.name_or_path), tmp_path / "out", DatasetSpec(),
                      source_label="p", records_path=str(frozen / "records.jsonl"))


def test_the_same_records_frozen_again_from_another_file_are_named_in_that_file(tmp_path):
    # Same records, same content-addressed folder: the origins beside it must follow today's source.
    from training_core.data.sources import RecordLocations

    records = [{"prompt": "encode: a b", "response": "b c"}, {"prompt": "encode: c d", "response": "d e"}]
    for name in ("old_export.jsonl", "today.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
        frozen = _raw_examples(str(tmp_path / name), tmp_path / "home").value
    assert RecordLocations(frozen.path).users(1) == f"line 2 of {tmp_path / 'today.jsonl'}"


def _jsonl(*prompts: str) -> str:
    return "".join(json.dumps({"prompt": p, "response": "r"}) + "\n" for p in prompts)


def test_a_uri_source_is_read_through_fsspec_and_named_with_its_scheme(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    memory = fsspec.filesystem("memory")
    day = f"memory://tessera-{tmp_path.name}/exports/2026-11-02"  # memory:// is one store per process
    try:
        memory.pipe(f"{day}/a.jsonl", _jsonl("a", "b").encode())
        with memory.open(f"{day}/sub/b.parquet", "wb") as handle:
            pq.write_table(pa.table({"prompt": ["c"], "response": ["d"]}), handle)
        memory.pipe(f"{day}/_SUCCESS", b"")
        memory.pipe(f"{day}/.staging-1/a.jsonl", b'{"prompt": "cut off')
        records, origins = read_records_with_origins(day)
        assert [r["prompt"] for r in records] == ["a", "b", "c"]
        assert [origins.describe(i) for i in (1, 2)] == [f"line 2 of {day}/a.jsonl",
                                                         f"row 0 (0-based) of {day}/sub/b.parquet"]
        assert read_records(f"{day}/a.jsonl") == records[:2]
        memory.pipe(f"{day}/a.jsonl", (_jsonl("a") + '{"prompt": "p"}\n').encode())
        with pytest.raises(SourceDataError, match=rf"^line 2 of {day}/a\.jsonl: missing field 'response'$"):
            read_records(day + "/")
        with pytest.raises(SourceDataError, match=rf"^source path {day}/missing does not exist$"):
            read_records(f"{day}/missing")
    finally:
        memory.rm(f"memory://tessera-{tmp_path.name}", recursive=True)

    (tmp_path / "day").mkdir()
    (tmp_path / "day" / "a.jsonl").write_text(_jsonl("x") + "{not json\n")
    with pytest.raises(SourceDataError, match=rf"^line 2 of file://{tmp_path}/day/a\.jsonl: not valid JSON"):
        read_records(f"file://{tmp_path}/day")
    (tmp_path / "day" / "a.jsonl").write_text(_jsonl("x"))
    assert read_records(f"file://{tmp_path}/day/a.jsonl") == [{"prompt": "x", "response": "r"}]
    # A store that cannot be reached (no credentials, no such protocol) is named with the cause.
    with pytest.raises(SourceDataError, match=r"^source nosuch://bucket/day: cannot open its filesystem "
                                              r"\(ValueError: Protocol not known: nosuch\)$"):
        read_records("nosuch://bucket/day")


def test_a_folder_of_gzipped_and_ndjson_parts_is_read_whole(tmp_path):
    day = tmp_path / "2026-11-02"
    day.mkdir()
    (day / "part-0.jsonl").write_text(_jsonl("a", "b"))
    (day / "part-1.JSONL.GZ").write_bytes(gzip.compress(_jsonl("c", "d", "e").encode()))
    (day / "part-2.ndjson").write_text(_jsonl("f", "g"))
    (day / "part-3.csv.gz").write_bytes(gzip.compress(b"prompt,response\nh,r\ni,r\n"))
    (day / "part-4.json.gz").write_bytes(gzip.compress(json.dumps([{"prompt": "j", "response": "r"}]).encode()))
    (day / "part-5.ndjson.gz").write_bytes(gzip.compress(_jsonl("k").encode()))
    (day / "_SUCCESS").write_text("")
    (day / ".part-0.jsonl.crc").write_bytes(b"\x00")
    records, origins = read_records_with_origins(day)
    assert [r["prompt"] for r in records] == list("abcdefghijk")
    assert [origins.describe(i) for i in (4, 6, 8, 9, 10)] == [
        f"line 3 of {day / 'part-1.JSONL.GZ'}", f"line 2 of {day / 'part-2.ndjson'}",
        f"line 3 of {day / 'part-3.csv.gz'}",
        f"item 0 (0-based) of {day / 'part-4.json.gz'}", f"line 1 of {day / 'part-5.ndjson.gz'}"]
    (day / "part-1.JSONL.GZ").write_bytes(gzip.compress((_jsonl("c") + '{"prompt": "p"}\n').encode()))
    with pytest.raises(SourceDataError, match=r"^line 2 of .*part-1\.JSONL\.GZ: missing field 'response'$"):
        read_records(day)


def test_a_folder_holding_files_it_does_not_read_is_refused_naming_them(tmp_path):
    day = tmp_path / "2026-11-02"
    (day / "notes").mkdir(parents=True)
    (day / "part-0.jsonl").write_text(_jsonl("a"))
    (day / "part-1.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    with pytest.raises(SourceDataError, match=rf"^{day}: 1 file\(s\) that are not data files: part-1\.jsonl\.zst; "
                                              r"a source folder holds only \.jsonl/\.ndjson/\.json/\.csv/\.parquet "):
        read_records(day)
    for name in ("README.md", "notes/todo.txt", "part-2.parquet.gz", "LICENSE", "part-3.tsv", "z.xlsx"):
        (day / name).write_text("x")
    with pytest.raises(SourceDataError, match=r": 7 file\(s\) that are not data files: LICENSE, README\.md, "
                                              r"notes/todo\.txt, part-1\.jsonl\.zst, part-2\.parquet\.gz and 2 more; "
                                              r".*Move the others out"):
        read_records(day)
    with pytest.raises(SourceDataError, match=r"part-2\.parquet\.gz: unsupported file type '\.parquet\.gz'"):
        read_records(day / "part-2.parquet.gz")
    assert read_records(day / "part-0.jsonl") == [{"prompt": "a", "response": "r"}]  # one file: the others unread


def test_a_corrupt_gzip_file_is_named(tmp_path):
    (tmp_path / "plain.jsonl.gz").write_text(_jsonl("a"))  # named .gz, never compressed
    with pytest.raises(SourceDataError, match=r"^.*plain\.jsonl\.gz: not a readable gzip file \(Not a gzipped file"):
        read_records(tmp_path / "plain.jsonl.gz")
    (tmp_path / "cut.csv.gz").write_bytes(gzip.compress(b"prompt,response\n" + b"p,r\n" * 100)[:-12])
    with pytest.raises(SourceDataError, match=r"^.*cut\.csv\.gz: not a readable gzip file \(Compressed file ended"):
        read_records(tmp_path / "cut.csv.gz")


def test_empty_csv_header_names_are_unused_columns_not_repeated_ones(tmp_path):
    path = tmp_path / "export.csv"
    path.write_bytes(b"prompt,response,,\r\na,b,,\r\n")  # a spreadsheet's unused trailing columns
    assert read_records(path) == [{"prompt": "a", "response": "b"}]
    path.write_text("prompt,,response,\nx,ignored,y,also ignored\n")
    assert read_records(path) == [{"prompt": "x", "response": "y"}]
    path.write_text("prompt,response,,response\nx,y,,z\n")  # a real name repeated is still refused
    with pytest.raises(SourceDataError, match=r"line 1 of .*export\.csv: column\(s\) \['response'\] appear more"):
        read_records(path)


def test_linked_folders_and_files_are_read_and_a_dangling_link_is_refused_by_name(tmp_path):
    # A day's export may link in a region's folder kept elsewhere: it is part of the day, as the
    # Parquet reader sees it; a link to an ancestor (or a second link to one folder) is read once.
    store, day = tmp_path / "store", tmp_path / "day"
    (store / "region-eu").mkdir(parents=True)
    day.mkdir()
    (store / "region-eu" / "part-0.jsonl").write_text(_jsonl("eu-1", "eu-2"))
    (store / "b.jsonl").write_text(_jsonl("b"))
    (day / "a.jsonl").write_text(_jsonl("a"))
    (day / "region-eu").symlink_to(store / "region-eu")
    (day / "region-eu-again").symlink_to(store / "region-eu")
    (store / "region-eu" / "loop").symlink_to(day)
    (day / "b.jsonl").symlink_to(store / "b.jsonl")
    for source in (str(day), f"file://{day}"):
        records, origins = read_records_with_origins(source)
        assert [r["prompt"] for r in records] == ["a", "b", "eu-1", "eu-2"]
        assert origins.describe(3) == f"line 2 of {source}/region-eu/part-0.jsonl"

    (day / "region-us.jsonl").symlink_to(store / "gone.jsonl")
    for source in (str(day), f"file://{day}"):
        with pytest.raises(SourceDataError, match=rf"^{source}/region-us\.jsonl: a link to {store}/gone\.jsonl, "
                                                  r"which leads to no file"):
            read_records(source)
