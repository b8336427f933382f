"""Demo task, packing and dataset writing: rows, files, the eval split, and the records refused while
writing (too long, special tokens in the text, a tokenizer without pad or eos)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from training_core.base_model import load_tokenizer
from training_core.data.dataset_writer import DatasetSpec, read_eval_records, write_dataset
from training_core.data.demo_task import encode_word, generate_records
from training_core.data.packing import IGNORE_INDEX, TokenizedExample, pack_examples, tokenize_example
from training_core.train.deepspeed_config import build_deepspeed_config
from training_core.train.config import TrainingConfig

from .tokenizer_support import is_eval_prompt, local_tokenizer


def test_demo_records_are_a_pure_function_of_the_partition():
    assert generate_records("2026-11-01", 50) == generate_records("2026-11-01", 50)
    assert generate_records("2026-11-01", 50) != generate_records("2026-11-02", 50)


def test_the_largest_demo_day_passes_its_own_duplicate_check(demo_model):
    """The demo draws words with replacement: a day larger than the cap would fail no_duplicate_rows."""
    from training_core.data.demo_task import MAX_RECORDS_PER_PARTITION
    from training_core.data.quality import MAX_REPEATED_RECORDS, SourceRecords

    records = generate_records("2026-11-01", MAX_RECORDS_PER_PARTITION)
    repeats = SourceRecords(records, load_tokenizer(demo_model.name_or_path), None, held_out={}).repeated
    assert 0 < repeats <= MAX_REPEATED_RECORDS * len(records)
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
    tokenizer = load_tokenizer(demo_model.name_or_path)
    eval_prompts = {r["prompt"] for r in read_eval_records(demo_dataset.path)}
    assert eval_prompts and all(is_eval_prompt(tokenizer, p, 0.05) for p in eval_prompts)
    records = generate_records("2026-11-01", 2000)
    train_prompts = {r["prompt"] for r in records if not is_eval_prompt(tokenizer, r["prompt"], 0.05)}
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

    train = [r for r in records if not is_eval_prompt(tokenizer, r["prompt"], spec.eval_fraction)]
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
    eval_split = [r for r in records if is_eval_prompt(tokenizer, r["prompt"], spec.eval_fraction)]
    assert read_eval_records(published.path) == eval_split[: spec.max_eval_examples]
    # the held-out examples past max_eval_examples are in neither split, and counted
    assert len(eval_split) > spec.max_eval_examples
    assert (published.eval_examples, published.held_out_examples) == (spec.max_eval_examples, len(eval_split))


def test_deepspeed_config_has_concrete_values():
    config = build_deepspeed_config(TrainingConfig(zero_stage=3, offload_optimizer="cpu", micro_batch_size=4,
                                                   gradient_accumulation_steps=2), world_size=2)
    assert config["train_batch_size"] == 16
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "auto" not in repr(config)




@pytest.mark.parametrize("field, record", [
    ("response", {"prompt": "encode: a b c d", "response": "d e f g </s>"}),
    ("prompt", {"prompt": "<s> encode: a b c d", "response": "d e f g"}),
], ids=["response ends with eos", "prompt starts with bos"])
def test_a_record_whose_text_holds_a_special_token_is_refused_naming_it(tmp_path, field, record):
    """Records formatted for another trainer were packed with the special ids parsed from their text,
    doubling Tessera's bos or eos; generation stops at the first eos, so exact-match was 0 for a perfect model."""
    import json
    import re

    from training_core.data.frozen_records import freeze_records
    from tests.unit.source_support import read_records_with_origins
    from training_core.errors import SourceDataError

    tokenizer = local_tokenizer(tmp_path / "tokenizer", bos_token="<s>", eos_token="</s>")  # Llama-style
    ordinary = generate_records("2026-11-01", 200)
    assert write_dataset(ordinary, tokenizer, tmp_path / "ordinary", DatasetSpec(), source_label="p").train_rows
    source = tmp_path / "source.jsonl"
    source.write_text("".join(json.dumps(r) + "\n\n" for r in [*ordinary, record]))
    records, origins = read_records_with_origins(source)
    frozen = freeze_records(records, origins, tmp_path / "raw")  # as raw_examples freezes them
    out = tmp_path / "out"
    out.mkdir()
    token = "</s>" if field == "response" else "<s>"
    with pytest.raises(SourceDataError, match=rf"p: line 201 of .*records\.jsonl, from line 401 of .*source\.jsonl "
                                              rf"\(prompt {re.escape(repr(record['prompt']))}\): its {field} holds the "
                                              rf"special token '{token}' \(id \d+\); strip it from the text: "
                                              rf"Tessera \(or the chat template\) puts bos"):
        write_dataset(records, tokenizer, out, DatasetSpec(), source_label="p", records_path=str(frozen.path))
    assert list(out.iterdir()) == []


def test_an_instruct_models_turn_end_eos_in_a_prompt_is_kept_and_gpt2s_endoftext_in_a_response_refused(tmp_path):
    """Qwen/Llama 3 instruct: eos is the chat turn end, which closes the user turn in a chat-format
    prompt. GPT-2 and its kin: unk == bos == eos == pad, still refused where it ends a response."""
    from training_core.errors import SourceDataError

    chat = local_tokenizer(tmp_path / "chat", eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            additional_special_tokens=["<|im_start|>"])
    records = [{**r, "prompt": f"<|im_start|> {r['prompt']} <|im_end|>"} for r in generate_records("2026-11-01", 200)]
    assert write_dataset(records, chat, tmp_path / "chat-out", DatasetSpec(), source_label="p").train_rows
    gpt2 = local_tokenizer(tmp_path / "gpt2", bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    gpt2.unk_token = "<|endoftext|>"
    assert {gpt2.unk_token_id, gpt2.bos_token_id, gpt2.pad_token_id} == {gpt2.eos_token_id}
    ending = [{"prompt": "encode: a b c d", "response": "d e f g <|endoftext|>"}]
    with pytest.raises(SourceDataError, match=r"its response holds the special token '<\|endoftext\|>'"):
        write_dataset(ending, gpt2, tmp_path / "gpt2-out", DatasetSpec(), source_label="p")


def test_a_chat_marker_in_a_prompt_is_kept_as_the_special_token_it_is(tmp_path):
    """Only bos, eos and pad are doubled by packing; a prompt laid out in the model's chat format is meant."""
    tokenizer = local_tokenizer(tmp_path / "tokenizer", bos_token="<s>", eos_token="</s>",
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

    local_tokenizer(tmp_path / "llama", bos_token="<s>", eos_token="</s>")  # saved without a pad token
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
    no_eos = local_tokenizer(tmp_path / "no-eos", bos_token="<s>")  # load_tokenizer has no eos to pad with
    with pytest.raises(ConfigError, match=r"tokenizer .*no-eos: it has no eos token"):
        write_dataset(records, no_eos, out, DatasetSpec(), source_label="p")
    assert list(out.iterdir()) == []




def _overlong_prompt(tokenizer, in_eval: bool, eval_fraction: float = 0.05) -> str:
    """A prompt far longer than seq_len=64 tokens that lands in the eval split (or not). It varies in
    words the demo tokenizer knows: the split hashes token ids, and unknown words are all <unk>."""
    base = "encode: " + " ".join("abcd" * 30)
    return next(prompt for prompt in (f"{base} {a} {b} {c}" for a in "abcdefgh" for b in "abcdefgh" for c in "abcdefgh")
                if is_eval_prompt(tokenizer, prompt, eval_fraction) == in_eval)


def test_an_overlong_record_in_the_eval_split_is_refused_like_one_in_the_train_split(tmp_path, demo_model):
    """An eval record longer than seq_len used to be kept, and evaluation crashed minutes later on
    positions beyond the model's; it must be refused at writing time, naming the record."""
    import json
    import re

    import pytest

    from training_core.data.frozen_records import freeze_records
    from tests.unit.source_support import read_records_with_origins
    from training_core.errors import SourceDataError

    tokenizer = load_tokenizer(demo_model.name_or_path)
    short = generate_records("2026-11-01", 60)
    long_prompt = _overlong_prompt(tokenizer, in_eval=True)
    source = tmp_path / "source.jsonl"
    source.write_text("".join(json.dumps(r) + "\n\n" for r in [*short, {"prompt": long_prompt, "response": "x"}]))
    records, origins = read_records_with_origins(source)
    frozen = freeze_records(records, origins, tmp_path / "raw")  # as raw_examples freezes them
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(SourceDataError, match=rf"p: line 61 of .*records\.jsonl, from line 121 of .*source\.jsonl "
                                              rf"\(prompt {re.escape(repr(long_prompt[:40]))}\): \d+ tokens do not fit seq_len=64"):
        write_dataset(records, tokenizer, out, DatasetSpec(), source_label="p", records_path=str(frozen.path))
    assert list(out.iterdir()) == []  # nothing half-written, not even a staging folder

    # The first overlong record in file order is named, whichever split it falls into.
    train_long = {"prompt": _overlong_prompt(tokenizer, in_eval=False), "response": "x"}
    with pytest.raises(SourceDataError, match=r"p: record 60 \(0-based\) \(prompt"):
        write_dataset([*short, {"prompt": long_prompt, "response": "x"}, train_long], tokenizer, out, DatasetSpec(),
                      source_label="p")
    with pytest.raises(SourceDataError, match=r"p: record 60 \(0-based\) \(prompt"):
        write_dataset([*short, train_long, {"prompt": long_prompt, "response": "x"}], tokenizer, out, DatasetSpec(),
                      source_label="p")
    assert list(out.iterdir()) == []
