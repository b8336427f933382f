"""Demo task, packing and dataset publication."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from training_core.base_model import load_tokenizer, train_demo_tokenizer
from training_core.data.dataset_writer import DatasetSpec, read_eval_records, write_dataset
from training_core.data.demo_task import ALPHABET, encode_word, generate_records, tokenizer_corpus
from training_core.data.packing import IGNORE_INDEX, TokenizedExample, is_eval_example, pack_examples, tokenize_example
from training_core.data import quality
from training_core.data.quality import DATASET_CHECK_NAMES, run_dataset_checks
from training_core.train.deepspeed_config import build_deepspeed_config
from training_core.train.config import TrainingConfig


def test_demo_records_are_a_pure_function_of_the_partition():
    assert generate_records("2026-11-01", 50) == generate_records("2026-11-01", 50)
    assert generate_records("2026-11-01", 50) != generate_records("2026-11-02", 50)


def test_the_largest_demo_day_passes_its_own_duplicate_check():
    """The demo draws words with replacement: a day larger than the cap would fail no_duplicate_rows."""
    from training_core.data.demo_task import MAX_RECORDS_PER_PARTITION
    from training_core.data.quality import MAX_REPEATED_RECORDS, repeated_record_count

    records = generate_records("2026-11-01", MAX_RECORDS_PER_PARTITION)
    assert repeated_record_count(records) <= MAX_REPEATED_RECORDS * len(records)
    with pytest.raises(ValueError, match="between 0 and 40,000"):
        generate_records("2026-11-01", MAX_RECORDS_PER_PARTITION + 1)


def test_demo_answer_is_not_a_copy_of_the_prompt():
    for record in generate_records("2026-11-01", 200):
        word = record["prompt"].split(" ", 1)[1].replace(" ", "")
        assert record["response"].replace(" ", "") == encode_word(word) != word


def test_packing_masks_prompts_and_padding():
    examples = [TokenizedExample([1, 5, 6], [7, 2]), TokenizedExample([1, 8], [9, 2]), TokenizedExample([1, 4, 4, 4], [3, 2])]
    packed = pack_examples(examples, seq_len=10, pad_token_id=0)
    assert packed["input_ids"].tolist() == [[1, 5, 6, 7, 2, 1, 8, 9, 2, 0], [1, 4, 4, 4, 3, 2, 0, 0, 0, 0]]
    m = IGNORE_INDEX
    assert packed["labels"].tolist() == [[m, m, m, 7, 2, m, m, 9, 2, m], [m, m, m, m, 3, 2, m, m, m, m]]
    assert packed["input_ids"].dtype == np.int32


def test_eval_split_is_by_prompt_so_no_prompt_leaks(demo_dataset, demo_model):
    eval_prompts = {r["prompt"] for r in read_eval_records(demo_dataset.path)}
    assert eval_prompts and all(is_eval_example(p, 0.05) for p in eval_prompts)
    records = generate_records("2026-11-01", 2000)
    train_prompts = {r["prompt"] for r in records if not is_eval_example(r["prompt"], 0.05)}
    assert not eval_prompts & train_prompts


def test_dataset_is_content_addressed_and_row_grouped(tmp_path, demo_model):
    tokenizer = load_tokenizer(demo_model.name_or_path)
    records = generate_records("2026-11-03", 1500)
    first = write_dataset(records, tokenizer, tmp_path, DatasetSpec(row_group_rows=32), source_label="p")
    second = write_dataset(records, tokenizer, tmp_path, DatasetSpec(row_group_rows=32), source_label="p")
    assert first == second  # same bytes ⇒ same digest and path; republishing is a no-op
    files = sorted(first.train_dir.glob("*.parquet"))
    sizes = [pq.ParquetFile(f).metadata.row_group(i).num_rows for f in files for i in range(pq.ParquetFile(f).num_row_groups)]
    assert sum(sizes) == first.train_rows and max(sizes) == 32
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".staging")]


def test_streamed_writing_gives_the_rows_and_files_of_packing_everything_at_once(tmp_path, demo_model):
    """The writer tokenizes in batches and writes a file whenever one is full; the result must be
    what tokenizing one record at a time and packing the whole day gives, cut into the same files."""
    from training_core.data import dataset_writer

    tokenizer = load_tokenizer(demo_model.name_or_path)
    records = generate_records("2026-11-04", 3 * dataset_writer._TOKENIZE_BATCH + 123)  # several batches
    spec = DatasetSpec(row_group_rows=32, rows_per_file=100)
    published = write_dataset(records, tokenizer, tmp_path, spec, source_label="p")

    train = [r for r in records if not is_eval_example(r["prompt"], spec.eval_fraction)]
    expected = pack_examples([tokenize_example(tokenizer, r["prompt"], r["response"]) for r in train],
                             spec.seq_len, tokenizer.pad_token_id)
    files = sorted(published.train_dir.glob("*.parquet"))
    tables = [pq.read_table(f) for f in files]
    assert [t.num_rows for t in tables[:-1]] == [100] * (len(files) - 1) and 0 < tables[-1].num_rows <= 100
    assert all(pq.ParquetFile(f).metadata.row_group(0).num_rows == 32 for f in files)
    for name in ("input_ids", "labels"):
        written = np.concatenate([np.asarray(t.column(name).combine_chunks().flatten()) for t in tables])
        np.testing.assert_array_equal(written.reshape(-1, spec.seq_len), expected[name])
    assert published.train_rows == len(expected["input_ids"]) and published.train_examples == len(train)
    eval_split = [r for r in records if is_eval_example(r["prompt"], spec.eval_fraction)]
    assert read_eval_records(published.path) == eval_split[: spec.max_eval_examples]


def test_deepspeed_config_has_concrete_values():
    config = build_deepspeed_config(TrainingConfig(zero_stage=3, offload_optimizer="cpu", micro_batch_size=4,
                                                   gradient_accumulation_steps=2), world_size=2)
    assert config["train_batch_size"] == 16
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "auto" not in repr(config)


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
def test_count_occurrences_equals_a_plain_scan(data, rows, width, vocab, use_start_token):
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
    counted = quality.count_occurrences(table, sequences, start_token=start_token, rows_per_chunk=2)
    assert counted == _naive_occurrences(table, sequences)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), rows=st.integers(1, 9), width=st.integers(1, 12), vocab=st.integers(1, 4))
def test_count_occurrences_from_given_starts_equals_a_plain_scan_from_them(data, rows, width, vocab):
    """Tiny chunks cut the starts with the rows; a window counts only where its start is marked."""
    table = np.array(data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=width, max_size=width),
                                        min_size=rows, max_size=rows)), dtype=np.int32)
    starts = np.array(data.draw(st.lists(st.lists(st.booleans(), min_size=width, max_size=width),
                                         min_size=rows, max_size=rows)), dtype=bool)
    r, i = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, width - 1))
    sequences = {tuple(table[r, i : i + data.draw(st.integers(1, width - i))].tolist())}
    expected = sum(tuple(table[row, i : i + len(s)].tolist()) == s for row in range(rows) for s in sequences
                   for i in range(width - len(s) + 1) if starts[row, i])
    assert quality.count_occurrences(table, sequences, rows_per_chunk=2, starts=starts) == expected


def _local_tokenizer(directory: Path, **special_tokens: str):
    """The demo's word-level tokenizer (one token per letter, built here: no download) with other
    special tokens, saved and loaded as a base model's is: without a pad token, it pads with eos."""
    from transformers import PreTrainedTokenizerFast

    backend = train_demo_tokenizer(tokenizer_corpus()).backend_tokenizer
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", **special_tokens).save_pretrained(directory)
    return load_tokenizer(str(directory))


# Qwen-like: no BOS, padded with a pad token of its own or (no pad token) with eos.
WITHOUT_BOS = {"own pad": {"eos_token": "</s>", "pad_token": "<pad>"}, "pad is eos": {"eos_token": "</s>"}}


def _tails_of_a_held_out_example(tokenizer, directory: Path):
    """A dataset whose training examples end with a held-out example's tokens ("<w> a b" → "z" for a
    held-out "a b" → "z"): other examples, not copies of it. Returns (dataset, held-out record)."""
    spec = DatasetSpec(seq_len=32, eval_fraction=0.3)
    held_out = next(f"{a} {b}" for a in ALPHABET for b in ALPHABET if is_eval_example(f"{a} {b}", spec.eval_fraction))
    records = [{"prompt": held_out, "response": "z"}]
    records += [{"prompt": f"{w} {held_out}", "response": "z"} for w in ALPHABET
                if not is_eval_example(f"{w} {held_out}", spec.eval_fraction)]
    return write_dataset(records, tokenizer, directory, spec, source_label="t"), records[0]


@pytest.mark.parametrize("special_tokens", WITHOUT_BOS.values(), ids=WITHOUT_BOS.keys())
def test_a_held_out_example_that_ends_training_examples_is_not_leaked_without_a_bos(tmp_path, special_tokens):
    """With a BOS only windows at an example's start were compared; without one every window was, so
    the tail of another training example counted as leaked and the blocking check stopped the day."""
    tokenizer = _local_tokenizer(tmp_path / "tokenizer", **special_tokens)
    assert tokenizer.bos_token_id is None
    dataset, _ = _tails_of_a_held_out_example(tokenizer, tmp_path / "out")
    assert dataset.train_examples > 10 and dataset.eval_examples == 1
    leakage = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer)}["no_eval_leakage"]
    assert leakage.passed and leakage.metadata["leaked_examples"] == 0, leakage.description


@pytest.mark.parametrize("special_tokens", WITHOUT_BOS.values(), ids=WITHOUT_BOS.keys())
def test_a_held_out_example_copied_into_training_is_leaked_once_without_a_bos(tmp_path, special_tokens):
    """The copy is packed after another example and before padding (eos, when pad is eos): it counts
    once, where it starts, and the training examples that merely end with its tokens do not."""
    tokenizer = _local_tokenizer(tmp_path / "tokenizer", **special_tokens)
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
    tokenizer = _local_tokenizer(tmp_path / "tokenizer", **special_tokens)
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
        tokenizer = _local_tokenizer(tmp_path / name, **special_tokens)
        dataset = write_dataset(records, tokenizer, tmp_path / name / "out", DatasetSpec(seq_len=20), source_label="t")
        check = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer)}["token_lengths"]
        assert check.metadata["mean_fill"] == pytest.approx(dataset.tokens / (dataset.train_rows * dataset.seq_len))
        checks[name] = (check.passed, check.metadata)
    assert checks["own pad"] == checks["pad is eos (Llama)"] == checks["bos is eos is pad (GPT-2)"]
    assert checks["own pad"][0] and checks["own pad"][1]["tokens_p50"] == 11.0
    assert quality.content_lengths(np.full((1, 8), IGNORE_INDEX)).tolist() == [0]  # a row training nothing fills nothing


@pytest.mark.parametrize("field, record", [
    ("response", {"prompt": "encode: a b c d", "response": "d e f g </s>"}),
    ("prompt", {"prompt": "<s> encode: a b c d", "response": "d e f g"}),
], ids=["response ends with eos", "prompt starts with bos"])
def test_a_record_whose_text_holds_a_special_token_is_refused_naming_it(tmp_path, field, record):
    """Records formatted for another trainer were packed with the special ids parsed from their text,
    doubling Tessera's bos or eos; generation stops at the first eos, so exact-match was 0 for a perfect model."""
    import json
    import re

    from training_core.data.sources import ORIGINS_FILE, read_records_with_origins
    from training_core.errors import SourceDataError

    tokenizer = _local_tokenizer(tmp_path / "tokenizer", bos_token="<s>", eos_token="</s>")  # Llama-style
    ordinary = generate_records("2026-11-01", 200)
    assert write_dataset(ordinary, tokenizer, tmp_path / "ordinary", DatasetSpec(), source_label="p").train_rows
    source = tmp_path / "source.jsonl"
    source.write_text("".join(json.dumps(r) + "\n\n" for r in [*ordinary, record]))
    records, origins = read_records_with_origins(source)
    frozen = tmp_path / "raw"  # as raw_examples publishes it: records.jsonl plus the hidden origins
    frozen.mkdir()
    (frozen / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    origins.save(frozen / ORIGINS_FILE)
    out = tmp_path / "out"
    out.mkdir()
    token = "</s>" if field == "response" else "<s>"
    with pytest.raises(SourceDataError, match=rf"p: line 201 of .*records\.jsonl, from line 401 of .*source\.jsonl "
                                              rf"\(prompt {re.escape(repr(record['prompt']))}\): its {field} holds the "
                                              rf"special token '{token}' \(id \d+\); strip it from the text: Tessera puts bos"):
        write_dataset(records, tokenizer, out, DatasetSpec(), source_label="p", records_path=str(frozen / "records.jsonl"))
    assert list(out.iterdir()) == []


def test_an_instruct_models_turn_end_eos_in_a_prompt_is_kept_and_gpt2s_endoftext_in_a_response_refused(tmp_path):
    """Qwen/Llama 3 instruct: eos is the chat turn end, which closes the user turn in a chat-format
    prompt. GPT-2 and its kin: unk == bos == eos == pad, still refused where it ends a response."""
    from training_core.errors import SourceDataError

    chat = _local_tokenizer(tmp_path / "chat", eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            additional_special_tokens=["<|im_start|>"])
    records = [{**r, "prompt": f"<|im_start|> {r['prompt']} <|im_end|>"} for r in generate_records("2026-11-01", 200)]
    assert write_dataset(records, chat, tmp_path / "chat-out", DatasetSpec(), source_label="p").train_rows
    gpt2 = _local_tokenizer(tmp_path / "gpt2", bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    gpt2.unk_token = "<|endoftext|>"
    assert {gpt2.unk_token_id, gpt2.bos_token_id, gpt2.pad_token_id} == {gpt2.eos_token_id}
    ending = [{"prompt": "encode: a b c d", "response": "d e f g <|endoftext|>"}]
    with pytest.raises(SourceDataError, match=r"its response holds the special token '<\|endoftext\|>'"):
        write_dataset(ending, gpt2, tmp_path / "gpt2-out", DatasetSpec(), source_label="p")


def test_a_chat_marker_in_a_prompt_is_kept_as_the_special_token_it_is(tmp_path):
    """Only bos, eos and pad are doubled by packing; a prompt laid out in the model's chat format is meant."""
    tokenizer = _local_tokenizer(tmp_path / "tokenizer", bos_token="<s>", eos_token="</s>",
                                 additional_special_tokens=["<|im_start|>"])
    marker = tokenizer.convert_tokens_to_ids("<|im_start|>")
    records = [{**r, "prompt": f"<|im_start|> {r['prompt']}"} for r in generate_records("2026-11-01", 200)]
    dataset = write_dataset(records, tokenizer, tmp_path / "out", DatasetSpec(), source_label="p")
    rows = pq.read_table(Path(dataset.path) / "train").column("input_ids").to_pylist()
    assert sum(row.count(marker) for row in rows) == dataset.train_examples


def test_a_tokenizer_without_a_pad_or_eos_token_is_refused_before_anything_is_written(tmp_path):
    """Bypassing load_tokenizer (which pads with eos) failed deep in packing with a bare TypeError."""
    from transformers import AutoTokenizer

    from training_core.errors import ConfigError

    _local_tokenizer(tmp_path / "llama", bos_token="<s>", eos_token="</s>")  # saved without a pad token
    no_pad = AutoTokenizer.from_pretrained(tmp_path / "llama")
    assert no_pad.pad_token_id is None
    records = generate_records("2026-11-01", 200)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConfigError, match=r"tokenizer .*llama: it has no pad token; load it with "
                                          r"training_core\.base_model\.load_tokenizer, which pads with eos"):
        write_dataset(records, no_pad, out, DatasetSpec(), source_label="p")
    with pytest.raises(ConfigError, match="pad_token_id is None: the tokenizer has no pad token"):
        pack_examples([tokenize_example(no_pad, "a b", "c")], 16, no_pad.pad_token_id)
    no_eos = _local_tokenizer(tmp_path / "no-eos", bos_token="<s>")  # load_tokenizer has no eos to pad with
    with pytest.raises(ConfigError, match=r"tokenizer .*no-eos: it has no eos token"):
        write_dataset(records, no_eos, out, DatasetSpec(), source_label="p")
    assert list(out.iterdir()) == []


def test_published_directories_name_the_files_that_changed_later(tmp_path):
    from training_core.storage import FILE_DIGESTS, changed_files, directory_digest

    folder = tmp_path / "d"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "a.parquet").write_bytes(b"aaaa")
    (folder / "manifest.json").write_text("{}")
    plain = directory_digest(folder)
    assert changed_files(folder) is None  # nothing recorded yet
    assert directory_digest(folder, record_files=True) == plain  # same digest: the record is hidden
    assert (folder / FILE_DIGESTS).is_file() and directory_digest(folder) == plain
    assert changed_files(folder) == []
    (folder / "train" / "a.parquet").write_bytes(b"aaab")
    (folder / "train" / "b.parquet").write_bytes(b"new")
    (folder / "manifest.json").unlink()
    assert changed_files(folder) == ["manifest.json (removed)", "train/a.parquet (changed)", "train/b.parquet (added)"]


def test_staging_folders_of_dead_writers_are_swept_and_live_ones_kept(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    from training_core.storage import staging_directory

    host = socket.gethostname()
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".staging-{host}-{int(ended.stdout)}-abc"
    live = tmp_path / f".staging-{host}-{os.getppid()}-def"  # our parent: alive
    old = tmp_path / ".staging-0123456789abcdef"  # the earlier naming, from any host
    for folder in (dead, live, old):
        (folder / "train").mkdir(parents=True)
    os.utime(old / "train", (0, 0))  # untouched for longer than the 6 h limit
    os.utime(old, (0, 0))
    stalled = tmp_path / ".staging-other-host-1-ghi"  # another host's: only its age counts
    (stalled / "train").mkdir(parents=True)
    os.utime(stalled, (0, 0))  # the folder is old, but a file inside it is being written now
    with staging_directory(tmp_path) as staging:
        assert staging.name.startswith(f".staging-{host}-{os.getpid()}-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, stalled.name])


def test_publishing_over_a_damaged_copy_replaces_it(tmp_path):
    from training_core.storage import directory_digest, publish_directory, staging_directory

    def publish() -> Path:
        with staging_directory(tmp_path) as staging:
            (staging / "part-0.parquet").write_bytes(b"rows")
            (staging / "part-1.parquet").write_bytes(b"more rows")
            digest = directory_digest(staging, record_files=True)
            return publish_directory(staging, tmp_path / digest[:16])

    final = publish()
    (final / "part-1.parquet").unlink()  # damaged after publication
    assert publish() == final
    assert (final / "part-1.parquet").read_bytes() == b"more rows"
    intact_inode = (final / "part-0.parquet").stat().st_ino
    assert publish() == final and (final / "part-0.parquet").stat().st_ino == intact_inode  # intact: kept
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


@pytest.mark.parametrize("publish_name", ["publish_directory", "replace_directory"])
def test_publishing_reaches_the_disk_before_the_rename_does(tmp_path, monkeypatch, publish_name):
    """Power lost after a publish must not leave the published name holding empty files: every
    file and folder is fsynced before the rename, and the parent (the new entry) after it."""
    import os

    from training_core import storage

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(storage.os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                        real_fsync(fd))[1])
    monkeypatch.setattr(storage.os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
    with storage.staging_directory(tmp_path) as staging:
        (staging / "train").mkdir()
        (staging / "train" / "part-0.parquet").write_bytes(b"rows")
        (staging / "config.json").write_text("{}")
        written = {str(staging), str(staging / "train"), str(staging / "train" / "part-0.parquet"),
                   str(staging / "config.json")}
        final = getattr(storage, publish_name)(staging, tmp_path / "published")
    renames = [i for i, (kind, _) in enumerate(events) if kind == "replace"]
    assert [events[i][1] for i in renames] == [str(final)]
    assert {path for kind, path in events[:renames[0]] if kind == "fsync"} == written
    assert ("fsync", str(tmp_path)) in events[renames[0]:]
    assert (final / "train" / "part-0.parquet").read_bytes() == b"rows"


@pytest.mark.parametrize("record_damage", ["deleted", "emptied", "not a mapping"])
def test_a_published_copy_whose_digest_record_is_gone_is_replaced_not_trusted(tmp_path, caplog, record_damage):
    from training_core.storage import FILE_DIGESTS, changed_files, directory_digest, publish_directory, staging_directory

    def publish() -> Path:
        with staging_directory(tmp_path) as staging:
            (staging / "part-0.parquet").write_bytes(b"rows")
            digest = directory_digest(staging, record_files=True)
            return publish_directory(staging, tmp_path / digest[:16])

    final = publish()
    record = final / FILE_DIGESTS
    if record_damage == "deleted":
        record.unlink()
    else:  # a crash left it empty, or someone edited it: unreadable is no record, never a traceback
        record.write_text("" if record_damage == "emptied" else "[1, 2]")
    (final / "part-0.parquet").unlink()  # damage nobody can see without the record
    with caplog.at_level("WARNING", logger="training_core.storage"):
        assert publish() == final
    assert (final / "part-0.parquet").read_bytes() == b"rows" and changed_files(final) == []
    assert f"{final} is not as published (no {FILE_DIGESTS} to verify it against): replacing it" in caplog.text
    if record_damage != "deleted":
        assert f"file digest record {record} is" in caplog.text


def _overlong_prompt(in_eval: bool, eval_fraction: float = 0.05) -> str:
    """A prompt far longer than seq_len=64 tokens that lands in the eval split (or not)."""
    base = "encode: " + " ".join("abcd" * 30)
    return next(prompt for prompt in (f"{base} {n}" for n in range(10_000))
                if is_eval_example(prompt, eval_fraction) == in_eval)


def test_an_overlong_record_in_the_eval_split_is_refused_like_one_in_the_train_split(tmp_path, demo_model):
    """An eval record longer than seq_len used to be kept, and evaluation crashed minutes later on
    positions beyond the model's; it must be refused at writing time, naming the record."""
    import json
    import re

    import pytest

    from training_core.data.sources import ORIGINS_FILE, read_records_with_origins
    from training_core.errors import SourceDataError

    tokenizer = load_tokenizer(demo_model.name_or_path)
    short = generate_records("2026-11-01", 60)
    long_prompt = _overlong_prompt(in_eval=True)
    source = tmp_path / "source.jsonl"
    source.write_text("".join(json.dumps(r) + "\n\n" for r in [*short, {"prompt": long_prompt, "response": "x"}]))
    records, origins = read_records_with_origins(source)
    frozen = tmp_path / "raw"  # as raw_examples publishes it: records.jsonl plus the hidden origins
    frozen.mkdir()
    (frozen / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    origins.save(frozen / ORIGINS_FILE)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(SourceDataError, match=rf"p: line 61 of .*records\.jsonl, from line 121 of .*source\.jsonl "
                                              rf"\(prompt {re.escape(repr(long_prompt[:40]))}\): \d+ tokens do not fit seq_len=64"):
        write_dataset(records, tokenizer, out, DatasetSpec(), source_label="p", records_path=str(frozen / "records.jsonl"))
    assert list(out.iterdir()) == []  # nothing half-written, not even a staging folder

    # The first overlong record in file order is named, whichever split it falls into.
    train_long = {"prompt": _overlong_prompt(in_eval=False), "response": "x"}
    with pytest.raises(SourceDataError, match=r"p: record 60 \(0-based\) \(prompt"):
        write_dataset([*short, {"prompt": long_prompt, "response": "x"}, train_long], tokenizer, out, DatasetSpec(),
                      source_label="p")
    with pytest.raises(SourceDataError, match=r"p: record 60 \(0-based\) \(prompt"):
        write_dataset([*short, train_long, {"prompt": long_prompt, "response": "x"}], tokenizer, out, DatasetSpec(),
                      source_label="p")
    assert list(out.iterdir()) == []


def test_a_duplicate_rows_failure_names_the_repeated_source_records(tmp_path, demo_model):
    import json

    from training_core.data.quality import run_dataset_checks
    from training_core.data.sources import ORIGINS_FILE, read_records_with_origins

    distinct = list({(r["prompt"], r["response"]): r for r in generate_records("2026-11-03", 80)}.values())[:60]
    source = tmp_path / "mine.jsonl"  # the user's file: lines 61 and 62 repeat lines 5 and 9
    source.write_text("".join(json.dumps(r) + "\n" for r in [*distinct, distinct[4], distinct[8]]))
    records, origins = read_records_with_origins(source)
    frozen = tmp_path / "raw" / "records.jsonl"  # as raw_examples freezes them, origins beside
    frozen.parent.mkdir()
    frozen.write_text("".join(json.dumps(r) + "\n" for r in records))
    origins.save(frozen.parent / ORIGINS_FILE)
    tokenizer = load_tokenizer(demo_model.name_or_path)
    # 11 tokens per record, rows of 16: one record per row, so a repeated record is a repeated row
    dataset = write_dataset(records, tokenizer, tmp_path / "out", DatasetSpec(seq_len=16, row_group_rows=16),
                            source_label="t")

    outcomes = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer, records, str(frozen))}
    check = outcomes["no_duplicate_rows"]
    assert not check.passed and check.metadata["duplicate_records"] == 2
    assert check.description.endswith(f": 2 source records repeat an earlier one, e.g. line 61 of {source} repeats "
                                      f"line 5 of {source}; line 62 of {source} repeats line 9 of {source}")
    without_records = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer)}
    assert "source records" not in without_records["no_duplicate_rows"].description


def test_a_source_exported_twice_fails_the_duplicate_check_even_when_packing_yields_distinct_rows(tmp_path, demo_model):
    # Rows of 64 tokens hold several records each: the second copy of the export packs into other
    # combinations, so no packed row repeats, yet every record does.
    from training_core.data.quality import run_dataset_checks

    distinct = list({(r["prompt"], r["response"]): r for r in generate_records("2026-11-03", 300)}.values())[:200]
    tokenizer = load_tokenizer(demo_model.name_or_path)
    twice = [*distinct, *distinct[3:], *distinct[:3]]
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
