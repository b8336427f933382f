"""Demo task, packing and dataset publication."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from training_core.base_model import load_tokenizer
from training_core.data.dataset_writer import DatasetSpec, read_eval_records, write_dataset
from training_core.data.demo_task import encode_word, generate_records
from training_core.data.packing import IGNORE_INDEX, TokenizedExample, is_eval_example, pack_examples
from training_core.train.deepspeed_config import build_deepspeed_config
from training_core.train.config import TrainingConfig


def test_demo_records_are_a_pure_function_of_the_partition():
    assert generate_records("2026-11-01", 50) == generate_records("2026-11-01", 50)
    assert generate_records("2026-11-01", 50) != generate_records("2026-11-02", 50)


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


def test_deepspeed_config_has_concrete_values():
    config = build_deepspeed_config(TrainingConfig(zero_stage=3, offload_optimizer="cpu", micro_batch_size=4,
                                                   gradient_accumulation_steps=2), world_size=2)
    assert config["train_batch_size"] == 16
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "auto" not in repr(config)
