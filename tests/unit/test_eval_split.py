"""The train/eval split: the same prompt is held out on every day of a training window and in every
text form its tokenizer reads alike, so no held-out prompt is ever trained on."""

from __future__ import annotations

import unicodedata
from dataclasses import replace

import pytest

from training_core.data.dataset_writer import DatasetSpec, read_eval_records, write_dataset
from training_core.data.demo_task import generate_records
from training_core.data.quality import run_dataset_checks
from training_core.data.window import DatasetWindow

from .tokenizer_support import is_eval_prompt, local_tokenizer


def test_a_window_of_days_split_with_different_eval_fractions_is_refused_naming_them(tmp_path):
    """Day 2 raised eval_fraction (as the writer advises when a day holds out nothing): the same
    prompts recur daily, so most of day 2's held-out prompts were trained on from day 1."""
    tokenizer = local_tokenizer(tmp_path / "tokenizer", bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    records = generate_records("2026-11-01", 400)
    day1 = write_dataset(records, tokenizer, tmp_path / "1", DatasetSpec(eval_fraction=0.05), source_label="d1")
    day2 = write_dataset(records, tokenizer, tmp_path / "2", DatasetSpec(eval_fraction=0.2), source_label="d2")
    trained_on_day1 = {r["prompt"] for r in records if not is_eval_prompt(tokenizer, r["prompt"], 0.05)}
    assert {r["prompt"] for r in read_eval_records(day2.path)} & trained_on_day1  # the leak the refusal prevents

    refusal = (r"partitions 2026-11-01 \(eval_fraction=0\.05\), 2026-11-02 \(eval_fraction=0\.2\) were split with "
               r"different eval_fraction.*rematerialize training_dataset for them with one eval_fraction")
    with pytest.raises(ValueError, match=refusal):
        DatasetWindow.from_partitions({"2026-11-01": day1, "2026-11-02": day2})
    # a dataset handed over before PublishedDataset recorded its fraction: read from its manifest's spec
    with pytest.raises(ValueError, match=refusal):
        DatasetWindow.from_partitions({"2026-11-01": replace(day1, eval_fraction=None), "2026-11-02": day2})

    same = write_dataset(records, tokenizer, tmp_path / "3", DatasetSpec(eval_fraction=0.05), source_label="d3")
    window = DatasetWindow.from_partitions({"2026-11-01": day1, "2026-11-03": replace(same, eval_fraction=None)})
    assert window.partition_keys == ["2026-11-01", "2026-11-03"]


def test_a_window_mixing_a_day_split_by_prompt_text_is_refused_naming_the_day_to_rematerialize(tmp_path):
    """Days materialized before the split hashed prompt tokens were split by a hash of the prompt's
    text: upgrading does not make them stale, and most prompts held out on such a day would be
    trained on from a day split by tokens."""
    import json
    import shutil

    tokenizer = local_tokenizer(tmp_path / "tokenizer", bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    records = generate_records("2026-11-01", 400)
    day1 = write_dataset(records, tokenizer, tmp_path / "1", DatasetSpec(), source_label="d1")
    day2 = write_dataset(records, tokenizer, tmp_path / "2", DatasetSpec(), source_label="d2")
    # day 1 as the earlier writer published it: a manifest naming no split method, handed over
    # (pickled by Dagster) before PublishedDataset recorded the split
    older = tmp_path / "older"
    shutil.copytree(day1.path, older)
    manifest = json.loads((older / "manifest.json").read_text())
    del manifest["eval_split_method"]
    (older / "manifest.json").write_text(json.dumps(manifest))
    handed_over = replace(day1, path=str(older), eval_split_method=None, eval_fraction=None)

    assert handed_over.eval_split() == ("prompt-text", 0.05) and day2.eval_split() == ("prompt-token-ids", 0.05)
    with pytest.raises(ValueError, match=r"partitions 2026-11-01 \(split by prompt-text\), 2026-11-02 \(split by "
                                         r"prompt-token-ids\) were split by different methods.*rematerialize "
                                         r"training_dataset for 2026-11-01$"):
        DatasetWindow.from_partitions({"2026-11-01": handed_over, "2026-11-02": day2})
    assert DatasetWindow.from_partitions({"2026-11-01": day1, "2026-11-02": day2}).partition_keys == [
        "2026-11-01", "2026-11-02"]


def test_prompts_a_tokenizer_normalizes_alike_land_in_one_split(tmp_path):
    """An NFC normalizer (Qwen2's tokenizer has one) reads the NFC and NFD forms of a prompt as the same
    tokens: a split by raw text put 12 of 200 such pairs on both sides, and no_eval_leakage blocked the day."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    composed = [{"prompt": f"résumé café {i}", "response": f"ok {i}"} for i in range(200)]
    # the same records exported again by a system that writes NFD (macOS, some CMSs)
    decomposed = [{**r, "prompt": unicodedata.normalize("NFD", r["prompt"])} for r in composed]
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.normalizer, backend.pre_tokenizer = normalizers.NFC(), pre_tokenizers.Whitespace()
    backend.train_from_iterator([f"{r['prompt']} {r['response']}" for r in composed],
                                trainers.BpeTrainer(special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")

    dataset = write_dataset(composed + decomposed, tokenizer, tmp_path, DatasetSpec(), source_label="p")
    held_out = [unicodedata.normalize("NFC", r["prompt"]) for r in read_eval_records(dataset.path)]
    assert held_out and all(held_out.count(prompt) == 2 for prompt in held_out)  # both forms, or neither
    leakage = {o.name: o for o in run_dataset_checks(dataset.path, dataset.seq_len, tokenizer)}["no_eval_leakage"]
    assert leakage.passed, leakage.description
