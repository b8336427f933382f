"""Up-front checks of a trained model folder, so a missing or damaged one is named before evaluation
spends minutes on the base model. No torch here: only file names, sizes and headers are read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from training_core.errors import TesseraError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
MODEL_CONFIG = "config.json"
MODEL_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
MODEL_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class TrainedModelError(TesseraError, ValueError):
    """A trained model folder (adapter or full model) is missing, incomplete or unreadable."""


def check_trained_model_dir(folder: str | Path) -> Literal["adapter", "full"]:
    """What the folder holds: a PEFT adapter (adapter_config.json + adapter weights) or a full model
    (config.json + weights, possibly sharded). Raises TrainedModelError naming the folder and file."""
    folder = Path(folder)
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        raise TrainedModelError(f"trained model folder {folder}: {what}; expected the lora_adapter output folder")
    if not any(folder.iterdir()):
        raise TrainedModelError(f"trained model folder {folder}: is empty; expected {ADAPTER_CONFIG} + adapter "
                                f"weights (LoRA) or {MODEL_CONFIG} + model weights (full)")
    if (folder / ADAPTER_CONFIG).exists():
        _read_json_object(folder, ADAPTER_CONFIG)
        _check_weights(folder, _first_present(folder, ADAPTER_WEIGHTS, ADAPTER_CONFIG))
        return "adapter"
    if (folder / MODEL_CONFIG).exists():
        _read_json_object(folder, MODEL_CONFIG)
        if index := next((name for name in MODEL_WEIGHT_INDEXES if (folder / name).exists()), None):
            _check_shards(folder, index)
        else:
            _check_weights(folder, _first_present(folder, MODEL_WEIGHTS, MODEL_CONFIG))
        return "full"
    raise TrainedModelError(f"trained model folder {folder}: holds neither {ADAPTER_CONFIG} (LoRA adapter) nor "
                            f"{MODEL_CONFIG} (full model); found {', '.join(sorted(p.name for p in folder.iterdir()))}")


def _read_json_object(folder: Path, name: str) -> dict:
    try:
        value = json.loads((folder / name).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TrainedModelError(f"trained model folder {folder}: {name} is not readable JSON ({error})") from error
    if not isinstance(value, dict):
        raise TrainedModelError(f"trained model folder {folder}: {name} holds a {type(value).__name__}, "
                                "expected a JSON object")
    return value


def _first_present(folder: Path, names: tuple[str, ...], config: str) -> str:
    for name in names:
        if (folder / name).exists():
            return name
    raise TrainedModelError(f"trained model folder {folder}: has {config} but no weights ({' or '.join(names)})")


def _check_shards(folder: Path, index: str) -> None:
    weight_map = _read_json_object(folder, index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise TrainedModelError(f"trained model folder {folder}: {index} has no weight_map")
    for shard in sorted(set(weight_map.values())):
        if not (folder / shard).exists():
            raise TrainedModelError(f"trained model folder {folder}: {index} lists {shard}, which is missing")
        _check_weights(folder, shard)


def _check_weights(folder: Path, name: str) -> None:
    path = folder / name
    if not path.is_file() or path.stat().st_size == 0:
        raise TrainedModelError(f"trained model folder {folder}: {name} is empty or not a file")
    if name.endswith(".safetensors"):
        _check_safetensors_size(folder, name)


def _check_safetensors_size(folder: Path, name: str) -> None:
    """A safetensors file is an 8-byte header length, a JSON header, then the tensors the header's
    offsets describe: a truncated copy is shorter than the header says, found without loading it."""
    path = folder / name
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        header_length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < header_length <= size - 8:
            raise TrainedModelError(f"trained model folder {folder}: {name} is truncated or not safetensors "
                                    f"({size} bytes; no complete header)")
        try:
            header = json.loads(handle.read(header_length))
            data_end = max((int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"),
                           default=0)
        except (ValueError, AttributeError, KeyError, IndexError, TypeError) as error:  # JSON, UTF-8, shape
            raise TrainedModelError(f"trained model folder {folder}: {name} has a damaged safetensors header "
                                    f"({error!r})") from error
    expected = 8 + header_length + data_end
    if size != expected:
        raise TrainedModelError(f"trained model folder {folder}: {name} is {size} bytes, but its header describes "
                                f"{expected}; the file is truncated or damaged")
