"""The eval loss projects to the vocabulary only the positions it scores, and casts to fp32 only those
that predict a response token (full fp32 logits for 64 rows of 800 tokens at a 128k vocabulary filled
an 80 GB GPU), with the loss unchanged: checked against each record scored alone with all its logits."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.overrides import TorchFunctionMode

from training_core.base_model import train_demo_tokenizer
from training_core.data.demo_task import tokenizer_corpus
from training_core.data.packing import tokenize_examples
from training_core.evaluate.metrics import evaluate

VOCAB = 500  # larger than the tokenizer's: no hidden or attention size in these models is 500 wide
COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, **COMMON)
RECORDS = [  # two chunks (BATCH_SIZE): prompts of 9 to 13 tokens, then of 2 and 3 (bos included)
    {"prompt": "encode: a b c d e f g h i j k", "response": "b c"},
    {"prompt": "encode: m n o p q r s", "response": "c d e f"},
    {"prompt": "encode: a b c d e f g h i", "response": "z"},
    {"prompt": "encode:", "response": "q r s t u v"},
    {"prompt": "encode: x", "response": "a b c d e"},
]
BATCH_SIZE = 3


@pytest.fixture(scope="module")
def tokenizer():
    return train_demo_tokenizer(tokenizer_corpus())


def _llama():
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA_LIKE))


def _gpt2():
    return transformers.AutoModelForCausalLM.from_config(
        transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, **COMMON))


def _lora_over_llama():
    from peft import LoraConfig, get_peft_model

    # Random B matrices: the adapter changes the logits, so its forward is the one scored.
    return get_peft_model(_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"],
                                               init_lora_weights=False))


def _trocr_decoder():
    """A causal LM whose forward takes no logits_to_keep."""
    return transformers.AutoModelForCausalLM.from_config(transformers.TrOCRConfig(
        d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128, max_position_embeddings=64,
        **COMMON))


MODELS = {"llama": _llama, "gpt2": _gpt2, "lora over llama": _lora_over_llama, "trocr decoder": _trocr_decoder}


def _each_record_scored_alone(model, tokenizer) -> float:
    """The plain computation: every position's logits in fp32, one unpadded record at a time."""
    loss_sum, token_count = 0.0, 0
    for example in tokenize_examples(tokenizer, [r["prompt"] for r in RECORDS], [r["response"] for r in RECORDS]):
        ids = torch.tensor([example.prompt_ids + example.response_ids])
        labels = torch.tensor([[-100] * len(example.prompt_ids) + example.response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1].float()
        loss_sum += F.cross_entropy(logits[0], labels[0, 1:], ignore_index=-100, reduction="sum").item()
        token_count += len(example.response_ids)
    return loss_sum / token_count


def _scored_span_and_width(tokenizer, chunk: list[dict[str, str]]) -> tuple[int, int]:
    """Positions from the shortest prompt's last token to the end of the longest row, and the row width."""
    examples = tokenize_examples(tokenizer, [r["prompt"] for r in chunk], [r["response"] for r in chunk])
    width = max(len(e.prompt_ids) + len(e.response_ids) for e in examples)
    return width - (min(len(e.prompt_ids) for e in examples) - 1), width


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_eval_loss_equals_every_position_scored_and_projects_only_the_scored_span(kind, tokenizer, caplog):
    torch.manual_seed(0)
    model = MODELS[kind]().eval()
    projected_positions: list[int] = []  # per lm_head call: the loss pass first, then generation's steps
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, inputs, output: projected_positions.append(output.shape[1]))
    with caplog.at_level(logging.WARNING, logger="training_core.evaluate.metrics"):
        metrics = evaluate(model, tokenizer, RECORDS, batch_size=BATCH_SIZE)
    hook.remove()

    assert metrics.loss == pytest.approx(_each_record_scored_alone(model, tokenizer), rel=1e-5)
    chunks = [RECORDS[:BATCH_SIZE], RECORDS[BATCH_SIZE:]]
    spans, widths = zip(*(_scored_span_and_width(tokenizer, chunk) for chunk in chunks))
    assert all(span < width for span, width in zip(spans, widths))  # the records make the check meaningful
    if kind == "trocr decoder":  # its generation projects every prompt position at the first step too
        assert "TrOCRForCausalLM does not take logits_to_keep" in caplog.text
        assert set(widths) <= set(projected_positions)
    else:
        assert caplog.text == ""
        assert [n for n in projected_positions if n > 1] == list(spans)  # generation: one position a step

class _VocabularyWideTensors(TorchFunctionMode):
    """The dtype and element count of every tensor with a vocabulary-wide last dimension made inside."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[torch.dtype, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor) and result.dim() >= 2 and result.shape[-1] == VOCAB:
            self.made.append((result.dtype, result.numel()))
        return result


def test_a_bf16_model_casts_to_fp32_only_the_logits_of_response_tokens(tokenizer):
    torch.manual_seed(0)
    model = _llama().to(torch.bfloat16).eval()
    examples = tokenize_examples(tokenizer, [r["prompt"] for r in RECORDS], [r["response"] for r in RECORDS])
    response_tokens = sum(len(e.response_ids) for e in examples)
    span, _ = _scored_span_and_width(tokenizer, RECORDS)

    with _VocabularyWideTensors() as watched:
        metrics = evaluate(model, tokenizer, RECORDS, batch_size=len(RECORDS))

    fp32 = [numel for dtype, numel in watched.made if dtype == torch.float32]
    assert fp32 and max(fp32) <= response_tokens * VOCAB
    assert max(numel for _, numel in watched.made) <= len(RECORDS) * span * VOCAB
    assert metrics.loss == pytest.approx(_each_record_scored_alone(model, tokenizer), rel=1e-3)
