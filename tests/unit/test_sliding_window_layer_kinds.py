"""A config may set a sliding window that no layer uses (Qwen2 with use_sliding_window and every layer
below max_window_layers, or layer_types naming only full attention): those models attend in full, so
packed rows get no window either, and a packed example still attends as it does alone."""
from __future__ import annotations

import pytest
import torch

from training_core.train.model_setup import sliding_window
from training_core.train.packed_attention import attention_inputs, packed_rows

from .test_sliding_window_packing import COMMON, WINDOW, _row


def _every_layer_full(family: str):
    import transformers

    if family == "qwen2":  # layers from max_window_layers on slide: here none
        return transformers.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=COMMON["num_hidden_layers"], **COMMON)
    return transformers.Gemma3TextConfig(head_dim=16, sliding_window=WINDOW, layer_types=["full_attention"] * 2, **COMMON)


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text"])
def test_a_window_no_layer_uses_is_no_window_for_packed_rows(family):
    from transformers import AutoModelForCausalLM

    config = _every_layer_full(family)
    assert set(config.layer_types) == {"full_attention"} and config.sliding_window == WINDOW
    assert sliding_window(config) is None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids, labels, spans = _row()
    rows = packed_rows(ids, labels)
    inputs = {**rows, **attention_inputs(rows["position_ids"], "sdpa", torch.float32, sliding_window(config))}
    with torch.no_grad():
        packed = model(**inputs).logits[0]
        for start, end in spans:
            alone = model(input_ids=rows["input_ids"][:, start:end]).logits[0]  # the model's own masks: full
            assert torch.allclose(packed[start:end], alone, atol=1e-5, rtol=0), (start, end)
