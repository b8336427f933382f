"""Eval loss / perplexity and greedy exact-match on held-out prompts."""

from __future__ import annotations

import inspect
import logging
import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GenerationConfig

from training_core.data.packing import tokenize_examples
from training_core.data.prompt_format import PLAIN
from training_core.evaluate.model_folder import TrainedModelError, check_trained_model_dir
from training_core.evaluate.results import EvalMetrics
from training_core.evaluate.settings import EvalSettings

logger = logging.getLogger(__name__)


def load_model_for_eval(base_model_path: str, trained_model_dir: str | None = None, settings: EvalSettings | None = None):
    """The base model, or the trained result: a PEFT adapter over the base, or a full model; in the
    settings' precision, on their device (default: fp32, the GPU if this process sees one)."""
    settings = (settings or EvalSettings()).for_this_process()
    dtype = torch.bfloat16 if settings.precision == "bf16" else torch.float32
    if trained_model_dir is None:
        return AutoModelForCausalLM.from_pretrained(base_model_path, dtype=dtype).to(settings.device).eval()
    kind = check_trained_model_dir(trained_model_dir)
    if kind == "adapter":
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(base_model_path, dtype=dtype)
        with _naming_the_folder(trained_model_dir, f"as a PEFT adapter over {base_model_path}"):
            model = PeftModel.from_pretrained(base, trained_model_dir)
    else:
        with _naming_the_folder(trained_model_dir, "as a full model"):
            model = AutoModelForCausalLM.from_pretrained(trained_model_dir, dtype=dtype)
    return model.to(settings.device).eval()


@contextmanager
def _naming_the_folder(trained_model_dir: str, how: str):
    """safetensors, json and torch errors name neither the folder nor the file; the precheck reads only
    sizes and headers, so damage inside a file surfaces here."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - any loader failure; re-raised with the folder, chained
        raise TrainedModelError(
            f"trained model folder {trained_model_dir}: could not be loaded {how} ({type(error).__name__}: {error})"
        ) from error


@torch.no_grad()
def evaluate(model, tokenizer, records: list[dict[str, str]], batch_size: int = 64,
             prompt_format: str = PLAIN) -> EvalMetrics:
    """On the model's device, in its precision (logits are scored in fp32). ``prompt_format``: the one
    the records' dataset was written with (its prompts are laid out as in training)."""
    if not records:
        raise ValueError("evaluation needs at least one held-out record")
    examples = tokenize_examples(tokenizer, [r["prompt"] for r in records], [r["response"] for r in records],
                                 prompt_format)
    pad = tokenizer.pad_token_id
    device = next(model.parameters()).device
    keeps_logits = _takes_logits_to_keep(model)
    if not keeps_logits:
        logger.warning("%s does not take logits_to_keep: the eval loss projects every position to the vocabulary, "
                       "prompts included (more memory; the same loss)", type(_unwrapped(model)).__name__)
    loss_sum, token_count, matches = 0.0, 0, 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        # Loss: right-padded prompt+response, loss on response tokens only.
        width = max(len(e.prompt_ids) + len(e.response_ids) for e in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, e in enumerate(chunk):
            sequence = e.prompt_ids + e.response_ids
            ids[row, : len(sequence)] = torch.tensor(sequence)
            labels[row, len(e.prompt_ids) : len(sequence)] = torch.tensor(e.response_ids)
            mask[row, : len(sequence)] = 1
        # The first position that predicts a response token: the shortest prompt's last token.
        first_scored = max(min(len(e.prompt_ids) for e in chunk) - 1, 0)
        chunk_loss, chunk_tokens = _response_loss(model, ids.to(device), labels.to(device), mask.to(device),
                                                  first_scored, keeps_logits)
        loss_sum += chunk_loss
        token_count += chunk_tokens
        matches += _count_exact_matches(model, chunk, pad, tokenizer.eos_token_id, device)
    loss = loss_sum / token_count
    return EvalMetrics(loss=loss, perplexity=math.exp(min(loss, 50.0)), exact_match=matches / len(examples), examples=len(examples))


def _response_loss(model, ids, labels, mask, first_scored: int, keeps_logits: bool) -> tuple[float, int]:
    """Summed cross-entropy over the response tokens, and their count. Full-vocabulary logits for every
    position of a chunk, then their fp32 copy and log-softmax, take ~12 bytes per row x position x
    vocabulary entry (64 rows of 800 tokens at a 128k vocabulary: 80 GB); so the head projects only
    positions from ``first_scored`` on, and only those that predict a response token are cast to fp32."""
    kept = ids.shape[1] - first_scored
    logits_to_keep = {"logits_to_keep": kept} if keeps_logits else {}
    targets = labels[:, first_scored + 1 :]
    scored = targets != -100
    # From the end: the last `kept` positions, whether the model returned those or all of them.
    logits = model(input_ids=ids, attention_mask=mask, **logits_to_keep).logits[:, -kept:-1][scored]
    return F.cross_entropy(logits.float(), targets[scored], reduction="sum").item(), int(scored.sum())


def _unwrapped(model):
    """A PEFT model passes keyword arguments on to the model it wraps."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _takes_logits_to_keep(model) -> bool:
    """transformers' causal LMs project only the last ``logits_to_keep`` positions; a few (Whisper's,
    TrOCR's, xLSTM's decoders) do not take the argument."""
    return "logits_to_keep" in inspect.signature(_unwrapped(model).forward).parameters


def _count_exact_matches(model, chunk, pad: int, eos: int, device: torch.device) -> int:
    """Greedy decoding from left-padded prompts; a match is the whole response then eos."""
    width = max(len(e.prompt_ids) for e in chunk)
    ids = torch.full((len(chunk), width), pad, dtype=torch.long)
    mask = torch.zeros((len(chunk), width), dtype=torch.long)
    for row, e in enumerate(chunk):
        ids[row, width - len(e.prompt_ids) :] = torch.tensor(e.prompt_ids)
        mask[row, width - len(e.prompt_ids) :] = 1
    greedy = plain_greedy_decoding(max(len(e.response_ids) for e in chunk), pad, eos)
    with _checkpoint_defaults_set_aside(model, greedy):
        generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=greedy)
    answers = generated[:, width:].tolist()
    return sum(output[: len(e.response_ids)] == e.response_ids for output, e in zip(answers, chunk))


def plain_greedy_decoding(max_new_tokens: int, pad: int, eos: int) -> GenerationConfig:
    """Argmax at every step and nothing else: the sampling settings stay unset (the library's neutral
    defaults), so greedy decoding draws no "only used in sample-based generation" warnings."""
    return GenerationConfig(
        do_sample=False, num_beams=1, num_return_sequences=1, max_new_tokens=max_new_tokens, min_new_tokens=0,
        repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0,
        remove_invalid_values=False, renormalize_logits=False, use_cache=True, pad_token_id=pad, eos_token_id=eos,
    )


@contextmanager
def _checkpoint_defaults_set_aside(model, generation_config: GenerationConfig):
    """generate() fills every field left unset (None) in the config it is given from the model's own
    ``generation_config``, read from the checkpoint's generation_config.json (Qwen-Instruct ships
    repetition_penalty=1.05, which turns a right answer that repeats a prompt token into a miss). For
    some fields None is the only "off" (bad_words_ids, suppress_tokens, forced_bos_token_id,
    stop_strings, max_time ...), so an explicit config cannot keep them out: for the call, the model's
    own is the plain one too. A PEFT model generates through its base model, whose config it reads."""
    generating = _unwrapped(model)
    checkpoint_defaults = generating.generation_config
    generating.generation_config = generation_config
    try:
        yield
    finally:
        generating.generation_config = checkpoint_defaults
