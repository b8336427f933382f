"""The training_dataset checks: schema, empty and duplicate rows, token fill, eval leakage (example
starts with or without a BOS), and the training window's record of failed checks."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from training_core.base_model import load_tokenizer
from training_core.data.dataset_writer import DatasetSpec, read_eval_records, write_dataset
from training_core.data.demo_task import ALPHABET, generate_records
from training_core.data.packing import IGNORE_INDEX, pack_examples, tokenize_example
from training_core.data import quality
from training_core.data.quality import DATASET_CHECK_NAMES, run_dataset_checks

from .tokenizer_support import is_eval_prompt, local_tokenizer


def test_dataset_checks_pass_on_a_clean_dataset_in_the_declared_order(demo_dataset, demo_model):
    outcomes = run_dataset_checks(demo_dataset.path, demo_dataset.seq_len, load_tokenizer(demo_model.name_or_path))
    assert tuple(o.name for o in outcomes) == DATASET_CHECK_NAMES
    assert all(o.passed for o in outcomes), [o for o in outcomes if not o.passed]


def test_dataset_checks_catch_a_duplicated_row_and_a_leaked_eval_example(tmp_path, demo_dataset, demo_model):
    tokenizer = load_tokenizer(demo_model.name_or_path)
    copy = Path(shutil.copytree(demo_dataset.path, tmp_path / "dataset"))
    first_file = sorted((copy / "train").glob("*.parquet"))[0]
    table = pq.read_table(first_file)
    held_out = read_eval_records(copy)[0]
    example = tokenize_example(tokenizer, held_out["prompt"], held_out["response"])
    leaked = example.prompt_ids + example.response_ids
    width = len(table.column("input_ids")[0])
    leaked_row = leaked + [tokenizer.pad_token_id] * (width - len(leaked))
    extra = pa.table({"input_ids": [table.column("input_ids")[0].as_py(), leaked_row],
                      "labels": [table.column("labels")[0].as_py(), leaked_row]}, schema=table.schema)
    pq.write_table(pa.concat_tables([table, extra]), first_file)

    outcomes = {o.name: o for o in run_dataset_checks(str(copy), demo_dataset.seq_len, tokenizer)}
    assert not outcomes["no_duplicate_rows"].passed and outcomes["no_duplicate_rows"].metadata["duplicate_rows"] == 1
    assert not outcomes["no_eval_leakage"].passed and outcomes["no_eval_leakage"].metadata["leaked_examples"] == 1
    assert outcomes["schema"].passed and outcomes["no_empty_rows"].passed


def test_dataset_checks_read_one_row_group_at_a_time(demo_dataset, demo_model, monkeypatch):
    """A day's dataset need not fit in memory: no check reads the whole split at once."""
    read_table = pq.read_table

    def whole_table(source, *args, **kwargs):
        assert "train" not in Path(str(source)).parts, f"read the whole training split: {source}"
        return read_table(source, *args, **kwargs)  # the eval split is small (max_eval_examples)

    monkeypatch.setattr(pq, "read_table", whole_table)
    outcomes = run_dataset_checks(demo_dataset.path, demo_dataset.seq_len, load_tokenizer(demo_model.name_or_path))
    assert all(o.passed for o in outcomes)
    assert outcomes[1].metadata["rows"] == demo_dataset.train_rows


def test_ragged_rows_or_a_file_of_another_schema_fail_the_schema_check_by_name(tmp_path, demo_dataset, demo_model):
    tokenizer = load_tokenizer(demo_model.name_or_path)
    ragged = Path(shutil.copytree(demo_dataset.path, tmp_path / "ragged"))
    first_file = sorted((ragged / "train").glob("*.parquet"))[0]
    table = pq.read_table(first_file)
    short = table.column("input_ids")[0].as_py()[:-3]
    extra = pa.table({"input_ids": [short], "labels": [short]}, schema=table.schema)
    pq.write_table(pa.concat_tables([table, extra]), first_file)
    outcomes = {o.name: o for o in run_dataset_checks(str(ragged), demo_dataset.seq_len, tokenizer)}
    width = demo_dataset.seq_len
    assert not outcomes["schema"].passed
    assert outcomes["schema"].description == f"row widths [{width - 3}, {width}] != seq_len {width}"

    other = Path(shutil.copytree(demo_dataset.path, tmp_path / "other"))
    files = sorted((other / "train").glob("*.parquet"))
    pq.write_table(pa.table({"input_ids": [[1, 2]], "labels": [[1, 2]]}), other / "train" / "zz-extra.parquet")
    outcome = run_dataset_checks(str(other), demo_dataset.seq_len, tokenizer)[0]
    assert not outcome.passed and outcome.description.startswith(f"zz-extra.parquet: another schema than {files[0].name}")


def _naive_occurrences(rows: np.ndarray, sequences: set[tuple[int, ...]]) -> int:
    return sum(tuple(row[i : i + len(s)]) == s for row in rows.tolist() for s in sequences
               for i in range(len(row) - len(s) + 1))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), rows=st.integers(1, 9), width=st.integers(1, 12), vocab=st.integers(1, 4),
       use_start_token=st.booleans())
def test_finding_sequences_equals_a_plain_scan(data, rows, width, vocab, use_start_token):
    """Small vocabularies make overlapping, repeated and 0-token windows common; tiny chunks cross
    chunk boundaries. Sequences are cut from the rows (hits) or drawn at random (mostly misses)."""
    table = np.array(data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=width, max_size=width),
                                        min_size=rows, max_size=rows)), dtype=np.int32)
    sequences = set()
    for _ in range(data.draw(st.integers(1, 4))):
        r, i = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, width - 1))
        sequences.add(tuple(table[r, i : i + data.draw(st.integers(1, width - i))].tolist()))
    sequences |= set(map(tuple, data.draw(st.lists(st.lists(st.integers(0, vocab), min_size=1, max_size=width),
                                                   max_size=3))))
    start_token = data.draw(st.integers(0, vocab - 1)) if use_start_token else None
    # start_token only narrows where to look: a match starts with its sequence's first token anyway
    found = quality.SequenceIndex(sequences, start_token).find(table, rows_per_chunk=2)
    assert len(found) == _naive_occurrences(table, sequences)
    assert all(sequence in sequences and any(tuple(table[row, i : i + len(sequence)].tolist()) == sequence
                                             for i in range(width - len(sequence) + 1)) for row, sequence in found)
    assert [row for row, _ in found] == sorted(row for row, _ in found)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), rows=st.integers(1, 9), width=st.integers(1, 12), vocab=st.integers(1, 4))
def test_finding_sequences_from_given_starts_equals_a_plain_scan_from_them(data, rows, width, vocab):
    """Tiny chunks cut the starts with the rows; a window counts only where its start is marked."""
    table = np.array(data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=width, max_size=width),
                                        min_size=rows, max_size=rows)), dtype=np.int32)
    starts = np.array(data.draw(st.lists(st.lists(st.booleans(), min_size=width, max_size=width),
                                         min_size=rows, max_size=rows)), dtype=bool)
    r, i = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, width - 1))
    sequences = {tuple(table[r, i : i + data.draw(st.integers(1, width - i))].tolist())}
    expected = sum(tuple(table[row, i : i + len(s)].tolist()) == s for row in range(rows) for s in sequences
                   for i in range(width - len(s) + 1) if starts[row, i])
    assert len(quality.SequenceIndex(sequences).find(table, rows_per_chunk=2, starts=starts)) == expected


WITHOUT_BOS = {"own pad": {"eos_token": "</s>", "pad_token": "<pad>"}, "pad is eos": {"eos_token": "</s>"}}


def _tails_of_a_held_out_example(tokenizer, directory: Path):
    """A dataset whose training examples end with a held-out example's tokens ("<w> a b" → "z" for a
    held-out "a b" → "z"): other examples, not copies of it. Returns (dataset, held-out record)."""
    spec = DatasetSpec(seq_len=32, eval_fraction=0.3)
    held_out = next(f"{a} {b}" for a in ALPHABET for b in ALPHABET
                    if is_eval_prompt(tokenizer, f"{a} {b}", spec.eval_fraction))
    records = [{"prompt": held_out, "response": "z"}]
    records += [{"prompt": f"{w} {held_out}", "response": "z"} for w in ALPHABET
                if not is_eval_prompt(tokenizer, f"{w} {held_out}", spec.eval_fraction)]
    return write_dataset(records, tokenizer, directory, spec, source_label="t"), records[0]


@pytest.mark.parametrize("special_tokens", WITHOUT_BOS.values(), ids=WITHOUT_BOS.keys())
def test_a_held_out_example_that_ends_training_examples_is_not_leaked_without_a_bos(tmp_path, special_tokens):
    """With a BOS only windows at an example's start were compared; without one every window was, so
    the tail of another training example counted as leaked and the blocking check stopped the day."""
    tokenizer = local_tokenizer(tmp_path / "tokenizer", **special_tokens)
    assert tokenizer.bos_token_id is None
    dataset, _ = _tails_of_a_held_out_example(tokenizer, tmp_path / "out")
    assert dataset.train_examples > 10 and dataset.eval_examples == 1
    leakage = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer)}["no_eval_leakage"]
    assert leakage.passed and leakage.metadata["leaked_examples"] == 0, leakage.description


@pytest.mark.parametrize("special_tokens", WITHOUT_BOS.values(), ids=WITHOUT_BOS.keys())
def test_a_held_out_example_copied_into_training_is_leaked_once_without_a_bos(tmp_path, special_tokens):
    """The copy is packed after another example and before padding (eos, when pad is eos): it counts
    once, where it starts, and the training examples that merely end with its tokens do not."""
    tokenizer = local_tokenizer(tmp_path / "tokenizer", **special_tokens)
    dataset, held_out = _tails_of_a_held_out_example(tokenizer, tmp_path / "out")
    first_file = sorted((Path(dataset.path) / "train").glob("*.parquet"))[0]
    table = pq.read_table(first_file)
    copied = pack_examples([tokenize_example(tokenizer, "c d", "y"), tokenize_example(tokenizer, **held_out)],
                           dataset.seq_len, tokenizer.pad_token_id)
    extra = pa.table({name: copied[name].tolist() for name in ("input_ids", "labels")}, schema=table.schema)
    pq.write_table(pa.concat_tables([table, extra]), first_file)

    leakage = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer)}["no_eval_leakage"]
    assert not leakage.passed and leakage.metadata["leaked_examples"] == 1, leakage.description


LAYOUTS = {"no bos, pad is eos": {"eos_token": "</s>"},
           "bos is eos is pad (GPT-2)": {"bos_token": "</s>", "eos_token": "</s>"}}


@pytest.mark.parametrize("special_tokens", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_examples_start_after_a_trained_eos_not_after_a_bos_or_in_padding_that_are_eos(tmp_path, special_tokens):
    tokenizer = local_tokenizer(tmp_path / "tokenizer", **special_tokens)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    examples = [tokenize_example(tokenizer, "a b", "c"), tokenize_example(tokenizer, "", "d"),
                tokenize_example(tokenizer, "e", "f")]  # "": an example may start with its response
    packed = pack_examples(examples, seq_len=16, pad_token_id=tokenizer.pad_token_id)
    lengths = [len(e.prompt_ids) + len(e.response_ids) for e in examples]
    expected = np.zeros(16, dtype=bool)
    expected[np.cumsum([0, *lengths[:-1]])] = True
    assert sum(lengths) < 16 and packed["input_ids"][0, sum(lengths)] == tokenizer.eos_token_id
    starts = quality.example_starts(packed["input_ids"], packed["labels"], tokenizer.eos_token_id)
    assert starts[0].tolist() == expected.tolist()


# One vocabulary, three conventions for the special tokens: the same records pack into the same rows.
PAD_LAYOUTS = {"own pad": {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
               "pad is eos (Llama)": {"bos_token": "<s>", "eos_token": "</s>"},
               "bos is eos is pad (GPT-2)": {"bos_token": "</s>", "eos_token": "</s>"}}


def test_token_fill_is_the_same_whether_the_pad_token_is_its_own_or_eos(tmp_path):
    """Every token equal to the pad token counted as padding: with pad == eos each example's eos (and
    GPT-2's bos) did, so a day 55 % filled read 50 % (Llama) or 45 % (GPT-2), failing the blocking check."""
    records = generate_records("2026-11-01", 2000)  # 11 tokens an example: one per row of 20, 55 % filled
    checks = {}
    for name, special_tokens in PAD_LAYOUTS.items():
        tokenizer = local_tokenizer(tmp_path / name, **special_tokens)
        dataset = write_dataset(records, tokenizer, tmp_path / name / "out", DatasetSpec(seq_len=20), source_label="t")
        check = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer)}["token_lengths"]
        assert check.metadata["mean_fill"] == pytest.approx(dataset.tokens / (dataset.train_rows * dataset.seq_len))
        checks[name] = (check.passed, check.metadata)
    assert checks["own pad"] == checks["pad is eos (Llama)"] == checks["bos is eos is pad (GPT-2)"]
    assert checks["own pad"][0] and checks["own pad"][1]["tokens_p50"] == 11.0
    assert quality.content_lengths(np.full((1, 8), IGNORE_INDEX)).tolist() == [0]  # a row training nothing fills nothing


def _frozen_source(directory: Path, records: list[dict[str, str]]) -> tuple[Path, list[dict[str, str]], str]:
    """The user's file (``mine.jsonl``) read, and frozen as raw_examples freezes it with its origins
    beside: (the user's file, its records, the frozen copy's path)."""
    import json

    from tests.unit.source_support import read_records_with_origins
    from training_core.data.sources import ORIGINS_FILE

    source = directory / "mine.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    read, origins = read_records_with_origins(source)
    frozen = directory / "raw" / "records.jsonl"
    frozen.parent.mkdir()
    frozen.write_text("".join(json.dumps(r) + "\n" for r in read))
    origins.save(frozen.parent / ORIGINS_FILE)
    return source, read, str(frozen)


def test_a_duplicate_rows_failure_names_the_repeated_source_records(tmp_path, demo_model):
    distinct = list({(r["prompt"], r["response"]): r for r in generate_records("2026-11-03", 80)}.values())[:60]
    # the user's file: lines 61 and 62 repeat lines 5 and 9
    source, records, frozen = _frozen_source(tmp_path, [*distinct, distinct[4], distinct[8]])
    tokenizer = load_tokenizer(demo_model.name_or_path)
    # 11 tokens per record, rows of 16: one record per row, so a repeated record is a repeated row
    dataset = write_dataset(records, tokenizer, tmp_path / "out", DatasetSpec(seq_len=16, row_group_rows=16),
                            source_label="t")

    os.utime(frozen, (1_793_500_000, 1_793_500_000))  # when raw_examples froze it: 2026-11-01 02:26:40 UTC

    outcomes = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer, records, frozen,
                                                      max_repeated_records=0.01)}
    check = outcomes["no_duplicate_rows"]
    assert not check.passed and check.metadata["duplicate_records"] == 2
    # The lines are those of the frozen copy: a fix to the user's file reaches the check only through raw_examples.
    assert check.description.endswith(f": 2 source records (3.2%, more than the 1% allowed) repeat an earlier one, "
                                      f"e.g. line 61 of {source} repeats line 5 of {source}; line 62 of {source} "
                                      f"repeats line 9 of {source} (lines of the source as raw_examples froze it at "
                                      "2026-11-01 02:26 UTC; after fixing it, rematerialize raw_examples, then "
                                      "training_dataset)")
    without_records = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer)}
    assert "source records" not in without_records["no_duplicate_rows"].description


def test_max_repeated_records_lets_duplicate_rows_from_repeats_within_it_pass(tmp_path, demo_model):
    """Rows of one record each: a record exported twice is a repeated row. no_duplicate_rows failed on
    any repeated row whatever max_repeated_records allowed (even 1.0); it now judges the records."""
    distinct = list({(r["prompt"], r["response"]): r for r in generate_records("2026-11-03", 400)}.values())[:300]
    tokenizer = load_tokenizer(demo_model.name_or_path)
    records = [*distinct, *distinct[10:13]]  # 1 % repeated
    dataset = write_dataset(records, tokenizer, tmp_path / "out", DatasetSpec(seq_len=16), source_label="t")

    def duplicate_check(**limit):
        outcomes = run_dataset_checks(dataset.path, dataset.seq_len, tokenizer, records, **limit)
        return {o.name: o for o in outcomes}["no_duplicate_rows"]

    allowed = duplicate_check()
    assert allowed.metadata["duplicate_rows"] >= 1 and allowed.metadata["duplicate_records"] == 3
    assert allowed.passed, allowed.description
    assert "3 source records (1.0%, within the 5% allowed) repeat an earlier one, e.g. record 300 (0-based) " \
           "repeats record 10 (0-based)" in allowed.description
    refused = duplicate_check(max_repeated_records=0.005)
    assert not refused.passed and "(1.0%, more than the 0.5% allowed)" in refused.description
    # without the records, nothing explains a repeated row
    assert not {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer)}[
        "no_duplicate_rows"].passed


def test_records_that_differ_in_text_but_tokenize_alike_count_as_repeats(tmp_path):
    """An export written again in NFD, read by a tokenizer that normalizes to NFC (Qwen2's does): the
    model trains on every record twice, yet the check reported "0 repeated source records"."""
    import unicodedata

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    nfc = [{"prompt": f"résumé café {i}", "response": f"ok {i}"} for i in range(200)]
    nfd = [{"prompt": unicodedata.normalize("NFD", r["prompt"]), "response": r["response"]} for r in nfc]
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.normalizer, backend.pre_tokenizer = normalizers.NFC(), pre_tokenizers.Whitespace()
    backend.train_from_iterator([f"{r['prompt']} {r['response']}" for r in nfc],
                                trainers.BpeTrainer(special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    records = nfc + nfd
    dataset = write_dataset(records, tokenizer, tmp_path / "out", DatasetSpec(), source_label="t")

    outcomes = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer, records)}
    check = outcomes["no_duplicate_rows"]
    assert check.metadata["duplicate_records"] == 200 and not check.passed
    assert ("200 source records (50.0%, more than the 5% allowed) repeat an earlier one, e.g. record 200 (0-based) "
            "repeats record 0 (0-based) (other text, same tokens)") in check.description


def test_a_leaked_eval_example_is_named_by_its_line_and_training_row(tmp_path, demo_model):
    """The blocking leakage failure said only "1 held-out examples found in training rows"."""
    distinct = list({(r["prompt"], r["response"]): r for r in generate_records("2026-11-04", 500)}.values())[:400]
    source, records, frozen = _frozen_source(tmp_path, distinct)
    tokenizer = load_tokenizer(demo_model.name_or_path)
    dataset = write_dataset(records, tokenizer, tmp_path / "out", DatasetSpec(seq_len=64), source_label="t")
    held_out = read_eval_records(dataset.path)[0]
    line = records.index(held_out) + 1
    # a training row holding the held-out example, appended after the file's rows
    first_file = sorted((Path(dataset.path) / "train").glob("*.parquet"))[0]
    table = pq.read_table(first_file)
    copied = pack_examples([tokenize_example(tokenizer, **held_out)], dataset.seq_len, tokenizer.pad_token_id)
    extra = pa.table({name: copied[name].tolist() for name in ("input_ids", "labels")}, schema=table.schema)
    pq.write_table(pa.concat_tables([table, extra]), first_file)

    leakage = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer, records, frozen)}[
        "no_eval_leakage"]
    assert not leakage.passed and leakage.metadata["leaked_examples"] == 1
    assert leakage.description.endswith(f"e.g. held-out line {line} of {source} is in row {table.num_rows} of "
                                        f"train/{first_file.name}")
    without_records = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer)}[
        "no_eval_leakage"]
    assert without_records.description.endswith(f"e.g. held-out prompt {held_out['prompt'][:40]!r} is in row "
                                                f"{table.num_rows} of train/{first_file.name}")


def test_token_fill_leaves_out_the_last_row_and_still_fails_poor_packing(tmp_path, demo_model):
    """A small day at a large seq_len packs into one partly filled row: token_lengths (blocking) read
    its 30 % as poor packing, though no packing could do better."""
    tokenizer = load_tokenizer(demo_model.name_or_path)
    records = generate_records("2026-11-01", 120)
    small_day = write_dataset(records, tokenizer, tmp_path / "small", DatasetSpec(seq_len=4096), source_label="t")
    assert small_day.train_rows == 1
    check = {o.name: o for o in run_dataset_checks(small_day.path, small_day.seq_len, tokenizer)}["token_lengths"]
    assert check.passed and check.metadata["mean_fill"] < 0.5, check.description

    # one short example per row: poorly packed however many rows, and blocked
    dataset = write_dataset(records, tokenizer, tmp_path / "poor", DatasetSpec(seq_len=64), source_label="t")
    train_dir = Path(dataset.path) / "train"
    schema = pq.read_schema(next(train_dir.glob("*.parquet")))
    for path in train_dir.glob("*.parquet"):
        path.unlink()
    rows = [pack_examples([tokenize_example(tokenizer, **r)], dataset.seq_len, tokenizer.pad_token_id) for r in records]
    pq.write_table(pa.table({name: np.concatenate([r[name] for r in rows]).tolist() for name in ("input_ids", "labels")},
                            schema=schema), train_dir / "part-00000.parquet")
    check = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer)}["token_lengths"]
    assert not check.passed and check.metadata["fill_before_last_row"] < 0.2, check.description


def test_a_source_exported_twice_fails_the_duplicate_check_even_when_packing_yields_distinct_rows(tmp_path, demo_model):
    # Rows of 64 tokens hold several records each: the second copy of the export packs into other
    # combinations, so no packed row repeats, yet every record does.
    from training_core.data.quality import run_dataset_checks

    distinct = list({(r["prompt"], r["response"]): r for r in generate_records("2026-11-03", 300)}.values())[:200]
    tokenizer = load_tokenizer(demo_model.name_or_path)
    twice = [*distinct, *reversed(distinct)]  # in another order: no row packs the same records in the same order
    dataset = write_dataset(twice, tokenizer, tmp_path / "out", DatasetSpec(seq_len=64, row_group_rows=32),
                            source_label="t")
    check = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer, twice)}["no_duplicate_rows"]
    assert check.metadata["duplicate_rows"] == 0
    assert not check.passed and check.metadata["duplicate_records"] == 200
    assert "200 source records (50.0%, more than the 5% allowed) repeat an earlier one" in check.description
    # natural repeats below the limit pass, and are counted
    few = [*distinct, *distinct[:5]]
    dataset = write_dataset(few, tokenizer, tmp_path / "few", DatasetSpec(seq_len=64, row_group_rows=32),
                            source_label="t")
    check = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer, few)}["no_duplicate_rows"]
    assert check.passed and check.metadata["duplicate_records"] == 5


def test_a_training_window_names_days_that_failed_checks_and_caches_warmed_for_another_dataset():
    from dataclasses import replace

    from training_core.data import cache_version
    from training_core.data.batch_columns import TRAINING_COLUMNS
    from training_core.data.dataset_writer import PublishedDataset
    from training_core.data.window import DatasetWindow

    def day(digest: str, failed_checks=()) -> PublishedDataset:
        return PublishedDataset(f"/data/{digest}", digest, 10, 10, 2, 1, 1, 8, 80, failed_checks=failed_checks)

    window = DatasetWindow.from_partitions({
        "2026-11-01": day("a" * 64, ("no_duplicate_rows",)), "2026-11-02": day("b" * 64),
        "2026-11-03": replace(day("c" * 64), failed_checks=None),  # stored before checks were recorded
    })
    assert window.failed_checks() == {"2026-11-01": ("no_duplicate_rows",)}
    warmed = {key: cache_version(digest * 64, TRAINING_COLUMNS, "none")
              for key, digest in (("2026-11-01", "a"), ("2026-11-02", "b"), ("2026-11-03", "c"))}
    assert window.stale_caches(warmed) == []
    # 11-02's cache was warmed before its dataset was rematerialized with other content
    assert window.stale_caches({**warmed, "2026-11-02": cache_version("d" * 64, TRAINING_COLUMNS, "none")}) == [
        "2026-11-02"]


def _materialize_day(home: Path, selection: list[str], raw_examples_config: dict, partition: str = "2026-11-05"):
    """Real Dagster runs sharing one persistent instance, as UI launches do."""
    import dagster as dg

    from pipelines.graph import ASSETS
    from pipelines.resources_local import local_resources

    (home / "dagster").mkdir(parents=True, exist_ok=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("TESSERA_HOME", str(home))
    try:
        return dg.materialize(ASSETS, selection=selection, partition_key=partition, resources=local_resources(),
                              instance=dg.DagsterInstance.local_temp(str(home / "dagster")),
                              run_config={"ops": {"raw_examples": {"config": raw_examples_config}}} if "raw_examples" in selection
                              else None,
                              raise_on_error=False)
    finally:
        mp.undo()


def test_the_advice_after_a_failed_duplicate_check_fixes_the_day(tmp_path):
    """Fix the source, then rematerialize raw_examples and training_dataset: training_dataset alone
    re-reads the copy raw_examples froze, and fails again."""
    import json

    from assets.data_assets import refuse_days_that_failed_checks

    def duplicate_check(result):
        return {e.check_name: e for e in result.get_asset_check_evaluations()}["no_duplicate_rows"]

    distinct = list({(r["prompt"], r["response"]): r for r in generate_records("2026-11-05", 400)}.values())[:300]
    source = tmp_path / "exports" / "2026-11-05.jsonl"
    source.parent.mkdir()
    source.write_text("".join(json.dumps(r) + "\n" for r in distinct[:150] * 2))  # exported twice
    home, config = tmp_path / "home", {"source": str(tmp_path / "exports" / "{partition}.jsonl")}
    failed = duplicate_check(_materialize_day(home, ["base_model", "raw_examples", "training_dataset"], config))
    assert not failed.passed and f"line 151 of {source} repeats line 1 of {source}" in failed.description
    assert "as raw_examples froze it at" in failed.description

    source.write_text("".join(json.dumps(r) + "\n" for r in distinct))  # fixed
    assert not duplicate_check(_materialize_day(home, ["training_dataset"], config)).passed  # the frozen copy
    assert duplicate_check(_materialize_day(home, ["raw_examples", "training_dataset"], config)).passed

    with pytest.raises(Exception) as refused:
        refuse_days_that_failed_checks({"2026-11-05": ("no_duplicate_rows",)}, "row_group_cache")
    assert ("Fix that day's source data and rematerialize raw_examples and training_dataset for it"
            in str(refused.value))


def test_the_dataset_assets_record_their_published_folder_beside_the_io_managers_path(tmp_path):
    # `path` is the IO manager's: it records where it pickled the value, over any `path` of ours.
    result = _materialize_day(tmp_path, ["base_model", "raw_examples", "training_dataset"],
                              {"records_per_partition": 300})
    metadata = {e.asset_key.path[-1]: e.materialization.metadata for e in result.get_asset_materialization_events()}
    raw, dataset = result.output_for_node("raw_examples"), result.output_for_node("training_dataset")
    assert metadata["raw_examples"]["dataset_path"].value == str(Path(raw.path).parent)
    assert metadata["training_dataset"]["dataset_path"].value == dataset.path
    assert metadata["training_dataset"]["path"].value != dataset.path
