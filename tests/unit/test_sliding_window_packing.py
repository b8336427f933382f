"""Sliding-window models: a packed example attends as the model attends on its own, within the window.

transformers takes a 4-D mask as given, building no window into it; an example longer than the window
would otherwise train with full causal attention while evaluation and inference use the window."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from training_core.data.packing import IGNORE_INDEX
from training_core.train.model_setup import sliding_window
from training_core.train.packed_attention import SlidingWindow, attention_inputs, packed_rows

VOCAB, BOS, EOS, PAD = 96, 1, 2, 0
WINDOW = 4
COMMON = dict(vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, hidden_size=64,
              intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, initializer_range=0.3)  # sharp attention: what a token sees shows


def _config(family: str):
    import transformers

    if family == "mistral":  # every layer sliding, no layer_types: takes one mask
        return transformers.MistralConfig(sliding_window=WINDOW, **COMMON)
    if family == "gemma3_text":  # five sliding layers to one full by default; here layer 0 sliding, 1 full
        return transformers.Gemma3TextConfig(head_dim=16, sliding_window=WINDOW,
                                             layer_types=["sliding_attention", "full_attention"], **COMMON)
    # Qwen2: layers from max_window_layers on are sliding (layer 0 full, layer 1 sliding)
    return transformers.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **COMMON)


def _row() -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """One packed row: two examples, each several windows long, then padding."""
    rng = np.random.default_rng(0)
    ids, labels, spans = [], [], []
    for prompt, response in ((5, 8), (6, 11)):
        spans.append((len(ids), len(ids) + 1 + prompt + response))
        ids += [BOS, *rng.integers(3, VOCAB, prompt + response - 1), EOS]
        labels += [IGNORE_INDEX] * (1 + prompt) + ids[-response:]
    ids += [PAD] * (40 - len(ids))
    labels += [IGNORE_INDEX] * (40 - len(labels))
    return np.array([ids], np.int32), np.array([labels], np.int32), spans


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["mistral", "gemma3_text", "qwen2"])
def test_a_packed_example_longer_than_the_window_attends_as_it_does_alone(family, attention):
    from transformers import AutoModelForCausalLM

    config = _config(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    ids, labels, spans = _row()
    assert min(end - start for start, end in spans) > 3 * WINDOW
    rows = packed_rows(ids, labels)
    inputs = {**rows, **attention_inputs(rows["position_ids"], attention, torch.float32, sliding_window(config))}
    with torch.no_grad():
        packed = model(**inputs).logits[0]
        for start, end in spans:
            alone = model(input_ids=rows["input_ids"][:, start:end]).logits[0]  # the model's own masks
            assert torch.allclose(packed[start:end], alone, atol=1e-5, rtol=0), (start, end)


def test_the_window_and_its_layers_come_from_the_text_config():
    import transformers

    assert sliding_window(_config("mistral")) == SlidingWindow(size=WINDOW, per_layer_type=False)
    assert sliding_window(_config("qwen2")) == SlidingWindow(size=WINDOW, per_layer_type=True)
    assert sliding_window(transformers.Qwen2Config(**COMMON)) is None  # use_sliding_window off
    assert sliding_window(transformers.MistralConfig(sliding_window=None, **COMMON)) is None
    assert sliding_window(transformers.LlamaConfig(**COMMON)) is None
    only_sliding = transformers.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0, **COMMON)
    assert sliding_window(only_sliding) == SlidingWindow(size=WINDOW, per_layer_type=False)
    text = {name: value for name, value in COMMON.items() if name != "initializer_range"}
    multimodal = transformers.Gemma3Config(text_config=dict(head_dim=16, sliding_window=WINDOW, **text,
                                                            layer_types=["sliding_attention", "full_attention"]))
    assert sliding_window(multimodal) == SlidingWindow(size=WINDOW, per_layer_type=True)


def test_a_mask_per_layer_type_goes_to_the_models_device(tmp_path):
    """DeepSpeed's engine moves no inputs, a dict of masks included ("meta" stands for the GPU)."""
    from types import SimpleNamespace

    import pyarrow as pa
    import pyarrow.parquet as pq

    from training_core.train.batches import EpochBatches
    from training_core.train.config import TrainingConfig

    ids, labels, _ = _row()
    (tmp_path / "train").mkdir()
    pq.write_table(pa.table({"input_ids": pa.array(ids.tolist(), pa.list_(pa.int32())),
                             "labels": pa.array(labels.tolist(), pa.list_(pa.int32()))}),
                   tmp_path / "train" / "part-0.parquet")
    inputs = SimpleNamespace(train_dirs=[str(tmp_path / "train")], cache_dir=None, cache_size_limit_bytes=None,
                             cache_policy="evict")
    batches = EpochBatches(inputs, TrainingConfig(num_workers=1, micro_batch_size=1, max_steps=1), rank=0,
                           world_size=1, epoch=0, state=None)
    try:
        batch = batches.model_inputs(batches.next(), "meta", SlidingWindow(size=WINDOW, per_layer_type=True))
    finally:
        batches.close()
    masks = batch["attention_mask"]
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert {mask.device.type for mask in masks.values()} == {"meta"}
