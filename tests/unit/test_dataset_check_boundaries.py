"""Where the dataset checks and the freezing of a day's records draw their lines: a repeat share at
the limit, one duplicate row more than the repeats explain, the last row of a day of several, a leak
in a later row group, a held-out example leaked twice, and a day's records frozen again from another
file or holding non-ASCII text."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training_core.data.dataset_writer import DatasetSpec, read_eval_records, write_dataset
from training_core.data.demo_task import generate_records
from training_core.data.frozen_records import freeze_records
from training_core.data.packing import pack_examples, tokenize_example
from training_core.data.quality import SourceRecords, run_dataset_checks
from training_core.data.sources import ORIGINS_FILE, RecordOrigins, iter_records

from .tokenizer_support import is_eval_prompt, local_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return local_tokenizer(tmp_path_factory.mktemp("tokenizer"), bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _checks(dataset, tokenizer, records=None) -> dict:
    return {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer, records)}


def _insert_rows(dataset, rows_at: dict[int, tuple[list[int], list[int]]], row_group_size: int | None = None) -> Path:
    """The first training file again with ``rows_at`` (row number → (input_ids, labels)) inserted,
    in row groups of ``row_group_size`` (one row group without it): returns the file."""
    path = sorted((Path(dataset.path) / "train").glob("*.parquet"))[0]
    table = pq.read_table(path)
    columns = {name: table.column(name).to_pylist() for name in ("input_ids", "labels")}
    for row, (input_ids, labels) in sorted(rows_at.items()):
        columns["input_ids"].insert(row, input_ids)
        columns["labels"].insert(row, labels)
    pq.write_table(pa.table(columns, schema=table.schema), path, row_group_size=row_group_size)
    return path


def _day_at_the_repeat_limit(tokenizer, directory: Path):
    """200 records, 10 of them (5 %, the default limit) repeating a training record. 11 tokens a
    record in rows of 16: one record a row, so each repeat is one duplicate row. (records, dataset)"""
    distinct = list({(r["prompt"], r["response"]): r for r in generate_records("2026-11-03", 400)}.values())[:190]
    trained = [r for r in distinct if not is_eval_prompt(tokenizer, r["prompt"], DatasetSpec().eval_fraction)]
    records = [*distinct, *trained[:10]]
    return records, write_dataset(records, tokenizer, directory, DatasetSpec(seq_len=16), source_label="t")


def test_repeats_exactly_at_max_repeated_records_pass(tmp_path, tokenizer):
    records, dataset = _day_at_the_repeat_limit(tokenizer, tmp_path / "out")
    check = _checks(dataset, tokenizer, records)["no_duplicate_rows"]
    assert check.metadata == {"duplicate_rows": 10, "duplicate_records": 10}
    assert check.passed, check.description
    assert "10 source records (5.0%, within the 5% allowed) repeat an earlier one" in check.description


def test_one_duplicate_row_more_than_the_repeated_records_explain_fails(tmp_path, tokenizer):
    records, dataset = _day_at_the_repeat_limit(tokenizer, tmp_path / "out")
    first = pq.read_table(sorted((Path(dataset.path) / "train").glob("*.parquet"))[0]).slice(0, 1)
    copied = first.column("input_ids")[0].as_py(), first.column("labels")[0].as_py()
    # a copy of the first row, which no repeated record packed: 10 repeats explain 10 duplicate rows, not 11
    _insert_rows(dataset, {dataset.train_rows: copied})
    check = _checks(dataset, tokenizer, records)["no_duplicate_rows"]
    assert check.metadata == {"duplicate_rows": 11, "duplicate_records": 10}
    assert not check.passed
    assert check.description.startswith("11 duplicate packed rows, more than the repeated records explain: 10 source "
                                        "records (5.0%, within the 5% allowed)"), check.description


def test_token_fill_leaves_out_only_the_last_of_several_rows(tmp_path, tokenizer):
    """Three rows 55 % full and a last one of 15 %: 45 % with the last row, 55 % without it."""
    records = generate_records("2026-11-01", 200)
    dataset = write_dataset(records, tokenizer, tmp_path / "out", DatasetSpec(seq_len=20), source_label="t")
    train_dir = Path(dataset.path) / "train"
    schema = pq.read_schema(next(train_dir.glob("*.parquet")))
    for path in train_dir.glob("*.parquet"):
        path.unlink()
    examples = [tokenize_example(tokenizer, **r) for r in records[:3]] + [tokenize_example(tokenizer, "", "a")]
    assert [len(e.prompt_ids) + len(e.response_ids) for e in examples] == [11, 11, 11, 3]
    rows = [pack_examples([example], dataset.seq_len, tokenizer.pad_token_id) for example in examples]
    pq.write_table(pa.table({name: [row[name][0].tolist() for row in rows] for name in ("input_ids", "labels")},
                            schema=schema), train_dir / "part-00000.parquet")

    check = _checks(dataset, tokenizer)["token_lengths"]
    assert check.metadata["fill_before_last_row"] == pytest.approx(0.55)
    assert check.metadata["mean_fill"] == pytest.approx(0.45)
    assert check.passed, check.description


def _leaking_dataset(tokenizer, directory: Path):
    """A day in rows of 64 (five records a row), and one of its held-out records packed alone in a
    training row: (dataset, the held-out record, that row's input_ids, its labels)."""
    distinct = list({(r["prompt"], r["response"]): r for r in generate_records("2026-11-04", 600)}.values())[:500]
    dataset = write_dataset(distinct, tokenizer, directory, DatasetSpec(seq_len=64), source_label="t")
    held_out = read_eval_records(dataset.path)[0]
    copied = pack_examples([tokenize_example(tokenizer, **held_out)], dataset.seq_len, tokenizer.pad_token_id)
    return dataset, held_out, copied["input_ids"][0].tolist(), copied["labels"][0].tolist()


def test_a_leak_in_a_later_row_group_is_named_by_its_row_in_the_file(tmp_path, tokenizer):
    """A row is numbered in its file, not in its row group: row 40 of a file in row groups of 16 is
    not "row 8"."""
    dataset, held_out, input_ids, labels = _leaking_dataset(tokenizer, tmp_path / "out")
    path = _insert_rows(dataset, {40: (input_ids, labels)}, row_group_size=16)
    assert pq.ParquetFile(path).num_row_groups > 3

    leakage = _checks(dataset, tokenizer)["no_eval_leakage"]
    assert not leakage.passed and leakage.metadata["leaked_examples"] == 1
    assert leakage.description.endswith(f"e.g. held-out prompt {held_out['prompt'][:40]!r} is in row 40 of "
                                        f"train/{path.name}"), leakage.description


def test_a_held_out_example_in_two_training_rows_counts_twice_and_is_named_where_first_found(tmp_path, tokenizer):
    dataset, _, input_ids, labels = _leaking_dataset(tokenizer, tmp_path / "out")
    path = _insert_rows(dataset, {5: (input_ids, labels), 30: (input_ids, labels)})

    leakage = _checks(dataset, tokenizer)["no_eval_leakage"]
    assert not leakage.passed and leakage.metadata["leaked_examples"] == 2
    assert leakage.description.startswith("2 held-out examples found in training rows"), leakage.description
    assert leakage.description.endswith(f"is in row 5 of train/{path.name}"), leakage.description


def test_a_held_out_record_is_located_by_its_text_not_by_an_earlier_record_of_the_same_tokens(tokenizer):
    """Records that differ only in spacing tokenize alike (the tokenizer splits on whitespace): the
    held-out record named must be the one whose text was held out, not the first of its tokens."""
    held_out = {"prompt": "a b c", "response": "d"}
    spaced = {"prompt": "a  b c", "response": "d"}  # same tokens, other text
    example = tokenize_example(tokenizer, **held_out)
    assert example == tokenize_example(tokenizer, **spaced)
    sequence = tuple(example.prompt_ids + example.response_ids)

    source = SourceRecords([{"prompt": "x", "response": "y"}, spaced, held_out], tokenizer, None,
                           held_out={sequence: held_out})
    assert list(source.held_out_at.values()) == [2]
    assert source.where(2) == "record 2 (0-based)"


def _write_source(path: Path, records: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _freeze(source: Path, root: Path):
    origins = RecordOrigins()
    return freeze_records(iter_records(source, origins), origins, root)


def test_records_frozen_again_from_another_file_keep_their_digest_and_name_the_new_file(tmp_path):
    """The same records exported under another name: one frozen copy (the digest is of the records,
    not of where they came from), whose origins now name the new file, so that later errors name
    the file the user has today rather than yesterday's."""
    records = [{"prompt": f"p{i}", "response": "r"} for i in range(3)]
    yesterday = _write_source(tmp_path / "yesterday.jsonl", records)
    today = _write_source(tmp_path / "today.jsonl", records)
    root = tmp_path / "raw"

    first = _freeze(yesterday, root)
    assert RecordOrigins.load(first.folder / ORIGINS_FILE).describe(2) == f"line 3 of {yesterday}"
    second = _freeze(today, root)
    assert (second.digest, second.folder) == (first.digest, first.folder)
    assert freeze_records(records, None, tmp_path / "no-origins").digest == first.digest
    assert RecordOrigins.load(second.folder / ORIGINS_FILE).describe(2) == f"line 3 of {today}"


def test_a_frozen_day_of_non_ascii_text_is_written_as_utf_8_with_a_pinned_digest(tmp_path):
    # Pinned, computed once: a frozen day's digest names its folder, is raw_examples' data version
    # and goes into the manifest, hence the digest, of each dataset built from it. Written otherwise
    # (\u escapes, another separator), every non-ASCII day would read as changed and be rebuilt.
    records = [{"prompt": "résumé café", "response": "naïve"}, {"prompt": "日本語", "response": "✓ ok"}]
    frozen = freeze_records(records, None, tmp_path / "raw")
    assert frozen.path.read_text(encoding="utf-8") == ('{"prompt": "résumé café", "response": "naïve"}\n'
                                                       '{"prompt": "日本語", "response": "✓ ok"}\n')
    assert frozen.digest == "0356bc308d52a3ce568fb21b660d85453414549da5f7a1a52f3ec1503b83ca59"
