"""Base models: the demo's tiny Llama built from a config, or any Hugging Face model directory /
hub id. Both end as a directory `from_pretrained` can load, identified by a content digest; a hub id
becomes the local snapshot folder of one commit (`hub:<repo>@<commit sha>`), so training, evaluation
and `tessera reproduce` load that revision even after the hub's branch moves on.

torch, tokenizers and transformers are imported by the functions that use them: the Dagster code
location imports this module for `BaseModelRef`, and importing transformers' Llama classes costs
every Dagster process (code server, each run) seconds."""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from training_core.errors import ConfigError, ModelNotFoundError
from training_core.storage import (
    changed_files,
    directory_digest,
    outside_record,
    publish_directory,
    staging_directory,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


@dataclass(frozen=True)
class TinyLlamaSpec:
    """The demo model: small enough to train in a minute on two CPU cores."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"demo model hidden_size {self.hidden_size} must be a multiple of its "
                              f"{self.num_attention_heads} attention heads")


@dataclass(frozen=True)
class BaseModelRef:
    """What downstream assets receive. `name_or_path` is what `from_pretrained` is called with (a hub
    model's snapshot folder of one commit, named in `digest`)."""

    name_or_path: str
    digest: str
    parameters: int
    vocab_size: int | None  # None: the config names none
    source: str  # "demo" or "pretrained"


HUB_DIGEST_PREFIX = "hub:"
# What from_pretrained reads of a model repo besides weights: configs (the weights' index among them)
# and tokenizer files.
_HUB_CONFIG_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
# The weights from_pretrained loads, in its order of preference: (index of a sharded checkpoint, single
# file). Named exactly, not "*.safetensors": many repos hold the same weights again (Mistral's
# consolidated.safetensors next to its shards, .bin copies, ONNX, GGUF).
_HUB_WEIGHT_FORMATS = (("model.safetensors.index.json", "model.safetensors"),
                       ("pytorch_model.bin.index.json", "pytorch_model.bin"))  # older repos have no safetensors
_COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
# huggingface_hub's own errors are OSErrors (not cached offline, unknown repo or revision, HTTP) or
# ValueErrors (a malformed repo id); a connection failure outside snapshot_download is httpx2's.
_HUB_ERRORS: tuple[type[Exception], ...] = (OSError, ValueError)


@dataclass(frozen=True)
class HubRevision:
    """A hub base model as its digest records it: ``hub:<repo id>@<commit sha>``."""

    repo_id: str
    commit: str | None  # None: recorded before Tessera pinned hub revisions (``@None``)

    @classmethod
    def from_digest(cls, digest: str) -> HubRevision | None:
        """The hub model a base-model digest names, or None for a local folder's content digest."""
        if not digest.startswith(HUB_DIGEST_PREFIX):
            return None
        repo_id, _, commit = digest.removeprefix(HUB_DIGEST_PREFIX).partition("@")
        return cls(repo_id, commit if commit and commit != "None" else None)

    @property
    def digest(self) -> str:
        return f"{HUB_DIGEST_PREFIX}{self.repo_id}@{self.commit}"


def hub_revision_of_snapshot(path: str | Path) -> HubRevision | None:
    """The hub repo and commit a Hugging Face cache snapshot folder holds
    (``.../models--{org}--{name}/snapshots/{sha}``, ``models--{name}`` for a repo without org), or None
    for any other folder. huggingface_hub refuses "--" in repo ids, so the folder name splits back."""
    path = Path(path)
    repo_folder = path.parent.parent.name
    in_a_model_cache = path.parent.name == "snapshots" and repo_folder.startswith("models--")
    if not in_a_model_cache or not _COMMIT_SHA.fullmatch(path.name):
        return None
    return HubRevision(repo_folder.removeprefix("models--").replace("--", "/"), path.name)


def pinned_snapshot(hub: HubRevision, recorded_folder: Path) -> Path:
    """The snapshot folder of ``hub``'s commit that a run trained on: the recorded one if it is still
    there, else fetched again (from the Hugging Face cache, or the hub unless HF_HUB_OFFLINE).
    Raises OSError or ValueError when it cannot be had (not cached offline, gone from the hub)."""
    if recorded_folder.is_dir() and recorded_folder.name == hub.commit:
        return recorded_folder
    return hub_snapshot(hub.repo_id, hub.commit)


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot folder of a hub model at ``revision`` (a branch, tag or commit sha; None: the
    default branch), with what from_pretrained loads downloaded into the Hugging Face cache unless it is
    there already. The folder is named by the commit sha. HF_HUB_OFFLINE=1 resolves from the cache only
    (a branch as the cache last saw it). Raises OSError / ValueError when that revision cannot be had."""
    from huggingface_hub import snapshot_download

    folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=_HUB_CONFIG_FILES))
    for index, single_file in _HUB_WEIGHT_FORMATS:
        weights = hub_weight_files(folder, index, single_file)
        snapshot_download(repo_id, revision=folder.name, allow_patterns=weights)
        if all((folder / name).is_file() for name in weights):
            break
    return folder


def hub_weight_files(snapshot: Path, index: str, single_file: str) -> list[str]:
    """The weight files of one format to download into a snapshot folder that holds its configs: the
    shards the format's index (already downloaded) names in its weight_map, else the single file."""
    if not (snapshot / index).is_file():
        return [single_file]
    try:
        weight_map = json.loads((snapshot / index).read_text())["weight_map"]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{snapshot / index}: not a weights index with a weight_map ({error})") from error
    return sorted(set(weight_map.values()))


def hub_branch_commit(repo_id: str, branch: str = "main") -> str | None:
    """The commit a hub repo's branch points at now: asked of the hub unless HF_HUB_OFFLINE, else (or
    when the hub does not answer) as the local cache last saw it; None when neither knows."""
    import httpx2
    from huggingface_hub import HfApi, constants
    from huggingface_hub.file_download import repo_folder_name

    if not constants.is_offline_mode():
        try:
            return HfApi().model_info(repo_id, revision=branch).sha
        except (*_HUB_ERRORS, httpx2.HTTPError):
            pass  # the cache's view below
    ref = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "refs" / branch
    return ref.read_text().strip() if ref.is_file() else None


def train_demo_tokenizer(corpus: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained with `tokenizers` on the corpus (one token per letter)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS.values()))
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)


def build_demo_model(corpus: list[str], spec: TinyLlamaSpec, output_root: Path) -> BaseModelRef:
    """Train the tokenizer, build a randomly initialised tiny Llama, save both, publish by digest."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = train_demo_tokenizer(corpus)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # Same spec ⇒ same weights; fork_rng leaves the caller's global RNG as it was.
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    with staging_directory(output_root) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        digest = directory_digest(staging, record_files=True)
        final = publish_directory(staging, output_root / f"tiny-llama-{digest[:16]}")
    return BaseModelRef(
        name_or_path=str(final),
        digest=digest,
        parameters=sum(p.numel() for p in model.parameters()),
        vocab_size=config.vocab_size,
        source="demo",
    )


def resolve_pretrained(name_or_path: str, digest_records: Path | None = None) -> BaseModelRef:
    """Validate a local model directory or hub id by loading its config and tokenizer. With
    ``digest_records``, a local folder's per-file digests are kept there (never in the user's folder),
    so that a later change can be named file by file (:func:`base_model_changes`). A hub id
    (``org/name``, or ``org/name@revision`` to pin a branch, tag or commit) is resolved to the snapshot
    folder of one commit (:func:`hub_snapshot`): the ref names that folder and records the commit."""
    from transformers import AutoConfig, AutoTokenizer

    name_or_path = os.path.expanduser(name_or_path)
    path = Path(name_or_path)
    # A hub id is "name" or "org/name"; anything else (absolute, ./, ~, deeper paths) is a folder.
    looks_local = (path.is_absolute() or name_or_path.startswith(".") or path.exists()
                   or name_or_path.count("/") > 1)
    if looks_local and path.is_file():
        raise ModelNotFoundError(f"base model {name_or_path}: is a file; expected a directory written by save_pretrained")
    if looks_local and not path.is_dir():
        raise ModelNotFoundError(f"base model {name_or_path}: no such directory (working directory {Path.cwd()})")
    if looks_local and not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"base model {name_or_path}: no config.json there; expected a directory written by save_pretrained"
        )
    where = "" if looks_local else f" (not a directory under {Path.cwd()}, so read as a Hugging Face Hub id)"
    hub = None
    if not looks_local:
        repo_id, _, revision = name_or_path.partition("@")
        try:
            path = hub_snapshot(repo_id, revision or None)
        except _HUB_ERRORS as error:
            raise ModelNotFoundError(f"base model {name_or_path}{where}: cannot be had ({error})") from error
        hub = HubRevision(repo_id, path.name)
    try:
        config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:  # ValueError: no model_type, no usable tokenizer files
        raise ModelNotFoundError(f"base model {name_or_path}{where}: cannot be loaded ({error})") from error
    if tokenizer.eos_token_id is None:
        raise ModelNotFoundError(f"base model {name_or_path}: tokenizer defines no eos_token")
    _check_special_tokens_in_vocabulary(name_or_path, tokenizer, vocab_size(config))
    return BaseModelRef(
        name_or_path=str(path.resolve()) if looks_local else str(path),
        digest=hub.digest if hub else directory_digest(path, record_in=digest_records),
        parameters=0,
        vocab_size=vocab_size(config),  # nested for multimodal configs (Gemma 3's text_config)
        source="pretrained",
    )


def _check_special_tokens_in_vocabulary(name_or_path: str, tokenizer, model_vocab_size: int | None) -> None:
    """Refuse a tokenizer whose bos, eos or pad id has no row in the model's embeddings (a token added
    with add_special_tokens, the model never resized): every example holds bos/eos and every packed row
    pad, so training would refuse the data as "tokenized for another model" and evaluation would fail
    with a bare IndexError."""
    if model_vocab_size is None:
        return
    for role in ("bos_token", "eos_token", "pad_token"):
        token, token_id = getattr(tokenizer, role), getattr(tokenizer, f"{role}_id")
        if token_id is not None and token_id >= model_vocab_size:
            raise ModelNotFoundError(
                f"base model {name_or_path}: its tokenizer's {role} {token!r} has id {token_id}, outside the model's "
                f"vocabulary (vocab_size={model_vocab_size}, ids 0..{model_vocab_size - 1}), as when a token is added "
                "to the tokenizer without resizing the model: call model.resize_token_embeddings(len(tokenizer)) and "
                f"save_pretrained the model, or set {role} to a token inside the vocabulary"
            )


def base_model_changes(folder: Path, digest: str, digest_records: Path | None = None) -> list[str]:
    """What changed in a local base-model folder since its ``digest`` was taken: the files named
    ("path (changed|added|removed)") where a per-file record exists (its own, as the demo model's,
    or one in ``digest_records``), else ["contents (digest <old> then, <new> now)"]; [] when unchanged."""
    record = outside_record(digest_records, digest) if digest_records is not None else None
    changed = changed_files(folder, record if record is not None and record.is_file() else None)
    if changed is not None:
        return changed
    now = directory_digest(folder)
    return [] if now == digest else [f"contents (digest {digest[:12]} then, {now[:12]} now)"]


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.pad_token_id is None:
        # Common for Llama checkpoints: pad with eos; padded positions are masked in labels anyway.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@dataclass(frozen=True)
class TokenizerIdentity:
    """What decides the ids a record is scored on: how text becomes ids (a digest of the backend
    tokenizer.json, or of the vocabulary for a slow tokenizer), the bos put before each prompt and the
    eos after each response (training_core.data.packing.tokenize_example), as load_tokenizer resolves
    them: the same tokenizer.json with another bos/eos in tokenizer_config.json (Qwen2.5 base's eos
    <|endoftext|>, Instruct's <|im_end|>) scores other sequences. The pad token is left out: padding is
    masked from attention and labels, so it changes no scored token. Nothing stores it (the champion
    check computes both sides live), so what it holds may change."""

    text_digest: str
    bos: str | None  # "<s> (id 1)"; None: no bos is put before prompts
    eos: str

    def special_token_differences(self, other: TokenizerIdentity) -> list[tuple[str, str, str]]:
        """(role, this one's token, the other's) where they differ, "none" for a missing bos."""
        pairs = (("bos", self.bos, other.bos), ("eos", self.eos, other.eos))
        return [(role, mine or "none", theirs or "none") for role, mine, theirs in pairs if mine != theirs]


def tokenizer_identity(name_or_path: str) -> TokenizerIdentity:
    import hashlib

    tokenizer = load_tokenizer(name_or_path)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    described = backend.to_str() if backend is not None else json.dumps(
        {"vocab": sorted(tokenizer.get_vocab().items()), "special": sorted(map(str, tokenizer.all_special_tokens))})

    def named(token, token_id) -> str | None:
        return None if token_id is None else f"{token} (id {token_id})"

    return TokenizerIdentity(text_digest=hashlib.sha256(described.encode()).hexdigest(),
                             bos=named(tokenizer.bos_token, tokenizer.bos_token_id),
                             eos=named(tokenizer.eos_token, tokenizer.eos_token_id))


_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length")


def load_model_config(name_or_path: str):
    """The model's ``config.json`` as transformers reads it; the driver's checks share one load (for a
    hub id each load may go to the network)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name_or_path)


def vocab_size(model_config) -> int | None:
    """The vocabulary size in a model config (None if it has none: nothing to check)."""
    size = getattr(model_config.get_text_config(), "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _rope_extended(rope) -> bool:
    """Whether RoPE parameters scale the positions: one dict, or one per layer type (Gemma 3's
    {"full_attention": {...}, "sliding_attention": {...}})."""
    if not isinstance(rope, dict):
        return False
    if rope and all(isinstance(value, dict) for value in rope.values()):
        return any(map(_rope_extended, rope.values()))
    return rope.get("rope_type", rope.get("type", "default")) != "default"


def check_context_length(name_or_path: str, seq_len: int, model_config=None) -> None:
    """Refuse training rows longer than the model's positions, before any worker starts: a model
    with learned positions fails inside a worker with an index error (a device assert on a GPU),
    a rotary one trains on positions it never saw. A RoPE scaling in the model's config is taken
    as a deliberate extension and accepted. ``model_config``: already loaded, else read here."""
    config = model_config if model_config is not None else load_model_config(name_or_path)
    text = config.get_text_config()  # multimodal models (Gemma 3 from 4B) nest the text model's positions
    field, limit = next(((name, getattr(text, name)) for name in _CONTEXT_FIELDS
                         if isinstance(getattr(text, name, None), int)), (None, None))
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if limit is not None and seq_len > limit and not _rope_extended(rope):
        raise ConfigError(
            f"training rows of seq_len={seq_len} are longer than base model {name_or_path} allows ({field}={limit}); "
            "lower seq_len (training_dataset config) or use a model with a longer context"
        )
