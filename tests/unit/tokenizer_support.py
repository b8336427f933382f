"""Tokenizers for tests, built locally (no download): the demo's word-level vocabulary with the
special-token layouts of real model families (no BOS, pad == eos, bos == eos == pad)."""

from __future__ import annotations

from pathlib import Path

from training_core.base_model import load_tokenizer, train_demo_tokenizer
from training_core.data.demo_task import tokenizer_corpus


def local_tokenizer(directory: Path, **special_tokens: str):
    """The demo's word-level tokenizer (one token per letter, built here: no download) with other
    special tokens, saved and loaded as a base model's is: without a pad token, it pads with eos."""
    from transformers import PreTrainedTokenizerFast

    backend = train_demo_tokenizer(tokenizer_corpus()).backend_tokenizer
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", **special_tokens).save_pretrained(directory)
    return load_tokenizer(str(directory))


def is_eval_prompt(tokenizer, prompt: str, eval_fraction: float) -> bool:
    """Whether the dataset writer holds ``prompt`` out: `is_eval_example` of its tokens, tokenized as
    the writer tokenizes it."""
    from training_core.data.packing import is_eval_example, tokenize_example

    return is_eval_example(tokenize_example(tokenizer, prompt, "").prompt_ids, eval_fraction)
