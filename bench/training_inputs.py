"""The training benchmark's inputs: the tiny Llama, its tokenizer and a packed Parquet dataset,
built once under bench/.data/training/ and reused while their spec is unchanged."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training_core.base_model import TinyLlamaSpec, build_demo_model

# The model every configuration trains: the pipeline's demo model (training_core.base_model), on a
# 508-word vocabulary (+ 4 special tokens = 512).
_SPEC = TinyLlamaSpec()
HIDDEN, INTERMEDIATE, LAYERS, HEADS = _SPEC.hidden_size, _SPEC.intermediate_size, _SPEC.num_hidden_layers, \
    _SPEC.num_attention_heads
VOCAB = 512
SEQ_LEN, MICRO_BATCH, LORA_R = 64, 4, 16
WORD_TYPES = VOCAB - 4
PROMPT_WORDS, RESPONSE_WORDS = 20, 40  # 1 + 20 + 40 + 1 = 62 tokens: one example per 64-token row
RECORDS = 2400
INPUT_SPEC = {"version": 2, "vocab": VOCAB, "hidden": HIDDEN, "intermediate": INTERMEDIATE, "layers": LAYERS,
              "heads": HEADS, "seq_len": SEQ_LEN, "records": RECORDS, "seed": 0}


@dataclass(frozen=True)
class BenchInputs:
    model_dir: str
    train_dir: str
    cache_dir: str
    dataset_digest: str
    train_rows: int


def prepare_inputs(root: Path) -> BenchInputs:
    """Tokenizer + random-init tiny Llama + packed Parquet dataset; reused if present."""
    marker = root / "inputs.json"
    if marker.exists():
        saved = json.loads(marker.read_text())
        if saved.get("spec") == INPUT_SPEC and Path(saved["inputs"]["model_dir"]).exists():
            return BenchInputs(**saved["inputs"])
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)

    from transformers import AutoTokenizer

    from training_core.data.dataset_writer import DatasetSpec, write_dataset

    words = [f"w{index:03d}" for index in range(WORD_TYPES)]
    model = build_demo_model([" ".join(words)], _SPEC, root / "model")
    if model.vocab_size != VOCAB:
        raise RuntimeError(f"benchmark tokenizer has {model.vocab_size} tokens, expected {VOCAB}")
    model_dir = model.name_or_path
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    rng = np.random.default_rng(0)
    records = [
        {"prompt": " ".join(rng.choice(words, PROMPT_WORDS)), "response": " ".join(rng.choice(words, RESPONSE_WORDS))}
        for _ in range(RECORDS)
    ]
    dataset = write_dataset(records, tokenizer, root / "datasets", DatasetSpec(seq_len=SEQ_LEN),
                            source_label="bench-training")
    inputs = BenchInputs(str(model_dir), str(dataset.train_dir), str(root / "cache"), dataset.digest,
                         dataset.train_rows)
    marker.write_text(json.dumps({"spec": INPUT_SPEC, "inputs": inputs.__dict__}, indent=2))
    return inputs


def warm_row_group_cache(inputs: BenchInputs) -> None:
    """As in the pipeline, where the row_group_cache asset runs before lora_adapter. Done on every
    benchmark run: cheap (18 row groups), and entries written by an older cache format are replaced."""
    from training_core.data import CacheConfig, warm_cache
    from training_core.data.batch_columns import TRAINING_COLUMNS, TRAINING_TRANSFORM, TRAINING_TRANSFORM_VERSION
    from training_core.train.batches import DEFAULT_CACHE_SIZE_LIMIT_BYTES

    warm_cache(inputs.train_dir, CacheConfig(inputs.cache_dir, DEFAULT_CACHE_SIZE_LIMIT_BYTES),
               columns=TRAINING_COLUMNS, dataset_digest=inputs.dataset_digest, transform=TRAINING_TRANSFORM,
               transform_version=TRAINING_TRANSFORM_VERSION)
