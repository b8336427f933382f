"""Records are tokenized in batches (the dataset writer's and the duplicate check's own sizes), but
a record is named by its place in the day, never by its place in a batch: a bad record or a repeat
past the first batch is named by its own line, and the earlier record a repeat names is read back
from the frozen file as it is."""

from __future__ import annotations

import json

import pytest

from training_core.data.dataset_writer import DatasetSpec, write_dataset
from training_core.data.demo_task import generate_records
from training_core.data.frozen_records import freeze_records
from training_core.data.quality import SourceRecords
from training_core.data.sources import RecordOrigins, iter_records
from training_core.errors import SourceDataError

from .tokenizer_support import local_tokenizer

# Past the first tokenize batch of both the writer (2048 records) and the duplicate check (1024):
# enough records to cross them, read as Tessera reads a day, rather than patched smaller sizes.
DAY_RECORDS = 2100


def distinct_day_records() -> list[dict[str, str]]:
    """DAY_RECORDS demo records, none repeating another (a demo day repeats a few words)."""
    by_text = {(r["prompt"], r["response"]): r for r in generate_records("2026-11-01", DAY_RECORDS + 200)}
    return list(by_text.values())[:DAY_RECORDS]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return local_tokenizer(tmp_path_factory.mktemp("tokenizer"), bos_token="<s>", eos_token="</s>")


def test_a_bad_record_past_the_first_tokenize_batch_is_named_by_its_own_line(tmp_path, tokenizer):
    bad = {"prompt": "encode: a b c d", "response": "d e f g </s>"}  # its eos would end the example early
    records = generate_records("2026-11-01", DAY_RECORDS)
    source = tmp_path / "source.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in [*records, bad]))
    origins = RecordOrigins()
    frozen = freeze_records(iter_records(source, origins), origins, tmp_path / "raw")
    line = DAY_RECORDS + 1
    with pytest.raises(SourceDataError, match=rf"^day: line {line} of .*records\.jsonl, from line {line} of .*source\.jsonl"):
        write_dataset(iter_records(frozen.path), tokenizer, tmp_path / "out", DatasetSpec(), source_label="day",
                      records_path=str(frozen.path))


@pytest.mark.parametrize("repeat_at", [1024, DAY_RECORDS])  # the first record of the second batch; one further on
def test_a_repeat_past_the_first_tokenize_batch_is_counted_and_named_by_its_own_line(tmp_path, tokenizer, repeat_at):
    records = distinct_day_records()
    earlier = 5
    records.insert(repeat_at, records[earlier])
    frozen = freeze_records(records, None, tmp_path / "raw")
    source = SourceRecords(iter_records(frozen.path), tokenizer, str(frozen.path), held_out={})
    assert source.count == DAY_RECORDS + 1 and source.repeated == 1
    # The same text, read back from the frozen file: no "(other text, same tokens)".
    assert source.repeat_examples == [f"line {repeat_at + 1} of {frozen.path} repeats line {earlier + 1} of {frozen.path}"]
