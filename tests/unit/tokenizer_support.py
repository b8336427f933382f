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


# A chat template in the shape of ChatML: turns marked by special tokens, the assistant's ended by eos.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def chat_tokenizer(directory: Path, template: str | None = CHAT_TEMPLATE,
                   markers: tuple[str, ...] = ("<|user|>", "<|assistant|>"), **special_tokens: str):
    """The demo's tokenizer with turn ``markers`` added as special tokens and ``template`` as its chat
    template (saved as an instruct model's tokenizer is: chat_template.jinja), loaded as a base model's is."""
    from transformers import PreTrainedTokenizerFast

    backend = train_demo_tokenizer(tokenizer_corpus()).backend_tokenizer
    special_tokens = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", **special_tokens}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        additional_special_tokens=list(markers), **special_tokens)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    return load_tokenizer(str(directory))


def chat_model_folder(directory: Path) -> Path:
    """A tiny randomly initialised Llama (seeded) with :func:`chat_tokenizer`, saved as a user's model
    folder: its embeddings have rows for the turn markers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = chat_tokenizer(directory)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(directory)
    return directory
