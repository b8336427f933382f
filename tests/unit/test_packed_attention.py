"""Packed training rows: every example attends only to itself, so a packed row's loss is the sum of
its examples' losses as evaluation scores them, one at a time."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from training_core.data.demo_task import generate_records
from training_core.data.packing import IGNORE_INDEX, TokenizedExample, pack_examples, tokenize_example
from training_core.train.batches import EpochBatches
from training_core.train.config import TrainingConfig

from .tokenizer_support import local_tokenizer

SEQ_LEN = 48
LAYOUTS = {"own pad": {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
           "no bos, pad is eos": {"eos_token": "</s>"},
           "bos is eos is pad (GPT-2)": {"bos_token": "</s>", "eos_token": "</s>"}}


def _examples(tokenizer) -> list[TokenizedExample]:
    records = generate_records("2026-11-01", 14)
    examples = [tokenize_example(tokenizer, record["prompt"], record["response"]) for record in records]
    # An example may start with its response (no bos, empty prompt): its first token must not be a
    # label predicted from the example before it.
    return [*examples[:3], tokenize_example(tokenizer, "", records[0]["response"]), *examples[3:]]


def _tiny_model(tokenizer, family: str, attention: str):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    torch.manual_seed(0)
    # Weights far larger than a fresh model's (std 0.02), so that attention is sharp and what an
    # example may see changes its loss well beyond float error.
    if family == "llama":  # rotary positions, grouped-query attention
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
                             initializer_range=0.3)
    else:  # learned absolute positions
        config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=SEQ_LEN,
                            initializer_range=0.3)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()


def _summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss summed over tokens: position t predicts label t + 1."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).double(), labels[:, 1:].flatten(),
                                             ignore_index=IGNORE_INDEX, reduction="sum")


def _scored_alone(model, example: TokenizedExample) -> torch.Tensor:
    """As evaluation scores a held-out example: its tokens alone, the response's tokens the labels."""
    ids = torch.tensor([example.prompt_ids + example.response_ids], device=model.device)
    labels = torch.tensor([[IGNORE_INDEX] * len(example.prompt_ids) + example.response_ids], device=model.device)
    return _summed_token_loss(model(input_ids=ids).logits, labels)


def _packed_batch(tmp_path: Path, rows: dict[str, np.ndarray], attention: str, device: str = "cpu") -> dict:
    """The training loop's one batch over these packed rows, as EpochBatches gives it to the model."""
    directory = tmp_path / "train"
    directory.mkdir()
    table = pa.table({name: pa.array(rows[name].tolist(), pa.list_(pa.int32())) for name in ("input_ids", "labels")})
    pq.write_table(table, directory / "part-0.parquet")
    inputs = SimpleNamespace(train_dirs=[str(directory)], cache_dir=None, cache_size_limit_bytes=None,
                             cache_policy="evict")
    config = TrainingConfig(num_workers=1, micro_batch_size=len(rows["input_ids"]), max_steps=1, attention=attention)
    batches = EpochBatches(inputs, config, rank=0, world_size=1, epoch=0, state=None)
    try:
        return batches.model_inputs(batches.next(), device)
    finally:
        batches.close()


@pytest.mark.parametrize("family, attention", [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa")])
@pytest.mark.parametrize("special_tokens", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_packed_batch_loses_what_its_examples_lose_scored_alone(tmp_path, special_tokens, family, attention):
    tokenizer = local_tokenizer(tmp_path / "tokenizer", **special_tokens)
    examples = _examples(tokenizer)
    rows = pack_examples(examples, SEQ_LEN, tokenizer.pad_token_id)
    assert len(rows["input_ids"]) < len(examples) - 2, "each row should hold several examples"
    assert (rows["labels"][:, -1] == IGNORE_INDEX).any(), "some row should end in padding"
    model = _tiny_model(tokenizer, family, attention)

    batch = _packed_batch(tmp_path, rows, attention)
    with torch.no_grad():
        logits = model(**batch).logits
        packed = _summed_token_loss(logits, batch["labels"])
        alone = sum(_scored_alone(model, example) for example in examples)

    assert torch.isfinite(logits).all(), "a padding position attends to nothing"
    trained_alone = sum(len(example.response_ids) - (not example.prompt_ids) for example in examples)
    assert int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()) == trained_alone
    assert packed.item() == pytest.approx(alone.item(), rel=1e-6)


def test_positions_restart_and_attention_stays_within_each_example():
    from training_core.train.packed_attention import attention_inputs, packed_rows

    bos, eos, pad = 1, 2, 0
    # Row 0: two examples ([bos 5 | 6 eos], [bos 7 | eos]), then padding; row 1: one example filling it.
    input_ids = np.array([[bos, 5, 6, eos, bos, 7, eos, pad], [bos, 5, 6, 7, 8, 9, 6, eos]], dtype=np.int32)
    labels = np.array([[IGNORE_INDEX, IGNORE_INDEX, 6, eos, IGNORE_INDEX, 7, eos, IGNORE_INDEX],
                       [IGNORE_INDEX, IGNORE_INDEX, 6, 7, 8, 9, 6, eos]], dtype=np.int32)

    rows = packed_rows(input_ids, labels)
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3], list(range(8))]
    sdpa = attention_inputs(rows["position_ids"], "sdpa", torch.float32)["attention_mask"]
    assert sdpa.shape == (2, 1, 8, 8) and sdpa.dtype == torch.float32
    allowed = sdpa == 0
    assert (sdpa[~allowed] == torch.finfo(torch.float32).min).all()
    assert allowed[0, 0, 5].tolist() == [False] * 4 + [True, True, False, False]  # 7 sees its own bos and itself
    assert allowed[0, 0, 7].tolist() == [False] * 4 + [True] * 4  # padding: the last example's block, itself included
    assert torch.equal(allowed[1, 0], torch.ones(8, 8, dtype=torch.bool).tril())

    eager = attention_inputs(rows["position_ids"], "eager", torch.bfloat16)["attention_mask"]
    assert eager.dtype == torch.bfloat16
    assert torch.equal(eager == 0, allowed) and (eager[~allowed] == torch.finfo(torch.bfloat16).min).all()

    flash = attention_inputs(rows["position_ids"], "flash_attention_2", torch.bfloat16)
    assert "attention_mask" not in flash
    assert flash["cu_seq_lens_q"].tolist() == flash["cu_seq_lens_k"].tolist() == [0, 4, 8, 16]
    assert flash["cu_seq_lens_q"].dtype == torch.int32 and flash["max_length_q"] == flash["max_length_k"] == 8
    # Row 0 alone: its longest example (the last, with its padding) is 4 tokens, half the row.
    shorter = attention_inputs(rows["position_ids"][:1], "flash_attention_2", torch.bfloat16)
    assert shorter["cu_seq_lens_q"].tolist() == [0, 4, 8] and shorter["max_length_q"] == shorter["max_length_k"] == 4
    # Reader buffers are left as they were: labels are masked on a copy.
    assert labels[0].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 6, eos, IGNORE_INDEX, 7, eos, IGNORE_INDEX]


def test_every_sdpa_layer_keeps_the_one_mask_for_backward():
    """torch's sdpa turns a boolean mask into an additive one on each call: every layer would keep its own
    batch × seq² copy until backward (4 GiB at 8 rows of 4096 tokens on 16 layers in bf16)."""
    import transformers

    from training_core.train.packed_attention import attention_inputs, packed_rows

    seq_len, layers = 32, 4
    input_ids = np.tile(np.array([1, 5, 6, 2] * (seq_len // 4), dtype=np.int32), (2, 1))
    rows = packed_rows(input_ids, input_ids.copy())
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=seq_len)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    saved_masks: set[int] = set()

    def remember_masks(saved: torch.Tensor) -> torch.Tensor:
        if saved.dim() == 4 and saved.shape[-2:] == (seq_len, seq_len) and saved.shape[1] == 1:
            saved_masks.add(saved.untyped_storage().data_ptr())
        return saved

    with torch.autograd.graph.saved_tensors_hooks(remember_masks, lambda saved: saved):
        model(**rows, **attention_inputs(rows["position_ids"], "sdpa", torch.float32)).loss.backward()
    assert len(saved_masks) == 1, f"{len(saved_masks)} masks kept for backward across {layers} layers"


def _flash_attention_unavailable() -> str | None:
    """Why the flash_attention_2 path cannot run here, or None."""
    if not torch.cuda.is_available():
        return "flash_attention_2 needs a CUDA GPU: this path is not run on CPU"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "flash_attention_2 needs the flash-attn package"
    return None


FLASH_ATTENTION_UNAVAILABLE = _flash_attention_unavailable()


@pytest.mark.gpu
@pytest.mark.skipif(FLASH_ATTENTION_UNAVAILABLE is not None, reason=str(FLASH_ATTENTION_UNAVAILABLE))
def test_flash_attention_keeps_examples_apart_over_a_batch_of_rows(tmp_path):
    tokenizer = local_tokenizer(tmp_path / "tokenizer", **LAYOUTS["own pad"])
    examples = _examples(tokenizer)
    rows = pack_examples(examples, SEQ_LEN, tokenizer.pad_token_id)
    model = _tiny_model(tokenizer, "llama", "flash_attention_2").to("cuda", torch.bfloat16)
    batch = _packed_batch(tmp_path, rows, "flash_attention_2")
    on_gpu = {name: value.to("cuda") if isinstance(value, torch.Tensor) else value for name, value in batch.items()}
    with torch.no_grad():
        packed = _summed_token_loss(model(**on_gpu).logits, on_gpu["labels"])
        alone = sum(_scored_alone(model, example) for example in examples)
    assert packed.item() == pytest.approx(alone.item(), rel=2e-2)  # bf16


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_every_model_input_goes_to_the_models_device(tmp_path, attention):
    """DeepSpeed's engine moves no inputs: on a GPU, CPU batches would fail in the first forward.
    ("meta" stands for the GPU here: a device without storage that any CPU tensor can move to.)"""
    tokenizer = local_tokenizer(tmp_path / "tokenizer", **LAYOUTS["own pad"])
    rows = pack_examples(_examples(tokenizer), SEQ_LEN, tokenizer.pad_token_id)
    batch = _packed_batch(tmp_path, rows, attention, device="meta")
    tensors = {name: value for name, value in batch.items() if isinstance(value, torch.Tensor)}
    assert {"input_ids", "labels", "position_ids"} <= tensors.keys()
    assert {name: value.device.type for name, value in tensors.items()} == dict.fromkeys(tensors, "meta")
