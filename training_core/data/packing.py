"""Tokenize instruction records and pack them into fixed-length training rows.

Each row holds whole examples back to back (`<bos> prompt response <eos>`), padded at the end.
Labels are -100 on prompt and padding tokens, so the loss trains only the responses.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from training_core.data.prompt_format import PLAIN, prompt_token_ids
from training_core.errors import ConfigError, SourceDataError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenizedExample:
    prompt_ids: list[int]
    response_ids: list[int]  # ends with eos


# How is_eval_example splits, recorded in every dataset's manifest: a training window must not mix
# datasets split otherwise, or a prompt held out on one day is trained on from another. Datasets
# whose manifest names none were split by a hash of the prompt's text (before 2026-12-06).
EVAL_SPLIT_METHOD = "prompt-token-ids"
TEXT_EVAL_SPLIT_METHOD = "prompt-text"


def is_eval_example(prompt_ids: Sequence[int], eval_fraction: float) -> bool:
    """Split by a hash of the prompt's token ids (:attr:`TokenizedExample.prompt_ids`), not its text:
    prompts the model sees as one (text a tokenizer normalizes alike: NFC and NFD forms, full-width
    and ASCII letters, runs of spaces) always land in the same split, so no prompt can leak from
    training into evaluation, whatever the partition, record order or text form."""
    ids = np.asarray(prompt_ids, dtype="<i8").tobytes()  # fixed width and byte order: the same bytes everywhere
    bucket = int.from_bytes(hashlib.blake2b(ids, digest_size=8).digest(), "little") % 10_000
    return bucket < eval_fraction * 10_000


def tokenize_example(tokenizer, prompt: str, response: str, prompt_format: str = PLAIN) -> TokenizedExample:
    return tokenize_examples(tokenizer, [prompt], [response], prompt_format)[0]


def tokenize_examples(tokenizer, prompts: list[str], responses: list[str],
                      prompt_format: str = PLAIN) -> list[TokenizedExample]:
    """Each record as the prompt's tokens laid out by ``prompt_format`` (:mod:`prompt_format`: bos and
    the text, or the chat template's user turn) and the response's tokens followed by eos, in two
    batched tokenizer calls (a fast tokenizer encodes a batch in Rust, several times faster than one
    call per text)."""
    if not prompts:
        return []
    prompt_batch = prompt_token_ids(tokenizer, prompts, prompt_format)
    response_batch = tokenizer(responses, add_special_tokens=False)["input_ids"]
    return [TokenizedExample(prompt_ids=prompt_ids, response_ids=[*response_ids, tokenizer.eos_token_id])
            for prompt_ids, response_ids in zip(prompt_batch, response_batch)]


def content_lengths(labels: np.ndarray) -> np.ndarray:
    """How many tokens of each row ([n, width] labels) packed examples fill: up to and with the last
    trained label. Every packed example ends with a trained eos and padding follows the last one,
    so this holds whatever the pad token is; counting tokens that are not pad would count each eos
    (and GPT-2's bos, the eos token) as padding wherever pad == eos, which is every tokenizer without
    a pad token of its own (load_tokenizer pads with eos). A row that trains nothing, which packing
    never writes (no_empty_rows fails it), fills nothing."""
    trained = labels != IGNORE_INDEX
    return np.where(trained.any(axis=1), trained.shape[1] - np.argmax(trained[:, ::-1], axis=1), 0)


def example_starts(input_ids: np.ndarray, labels: np.ndarray, eos_token_id: int | np.ndarray) -> np.ndarray:
    """Where packed examples start in each row ([n, width] booleans), read from packing's layout:
    examples lie back to back from the row start, each ends with an eos that is trained (its label
    is not IGNORE_INDEX), and padding after the last one is not. Labels, not the tokens alone, tell
    an example's eos from padding (pad == eos, as in GPT-2 or Qwen) and from a BOS that is the eos
    token (GPT-2), whose label is IGNORE_INDEX like the rest of the prompt. An eos trained inside a
    response (its text spelled the eos token, in a dataset written before the writer refused such text)
    marks one start too many: the leakage check looks at one window more, training splits that example.
    ``eos_token_id``: the tokenizer's, or each row's as an [n, 1] array (:func:`row_eos_tokens`)."""
    trained = labels != IGNORE_INDEX
    ends = trained & (input_ids == eos_token_id)
    starts = np.zeros(input_ids.shape, dtype=bool)
    starts[:, 0] = True  # even a row that trains nothing: its tokens may still be a held-out example
    starts[:, 1:] = ends[:, :-1] & (np.arange(1, input_ids.shape[1]) < content_lengths(labels)[:, None])
    return starts


def row_eos_tokens(input_ids: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Each row's eos ([n, 1], for :func:`example_starts`) read from packing's layout, where no
    tokenizer is at hand (training): every packed example ends with a trained eos, so a row's last
    trained label is one. A row that trains nothing has no eos to read and no trained token to match
    it; its first token stands in."""
    last_trained = np.maximum(content_lengths(labels) - 1, 0)
    return np.take_along_axis(input_ids, last_trained[:, None], axis=1)


def check_fits(example: TokenizedExample, seq_len: int, describe: Callable[[], str]) -> None:
    """Refuse an example longer than `seq_len`, named by ``describe()``. Held-out examples are
    checked too: the model has no positions beyond the rows it trained on, so evaluation would fail."""
    length = len(example.prompt_ids) + len(example.response_ids)
    if length > seq_len:
        raise SourceDataError(
            f"{describe()}: {length} tokens do not fit seq_len={seq_len}; raise seq_len or shorten the record"
        )


def require_layout_tokens(tokenizer) -> None:
    """Refuse a tokenizer without the tokens every packed row needs, before anything is tokenized:
    eos ends each example and pad fills the row after the last one."""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer {name}: it has no eos token; every example ends with eos (it is what "
                          "generation stops at), so set tokenizer.eos_token to the token the model ends text with")
    if tokenizer.pad_token_id is None:
        raise ConfigError(f"tokenizer {name}: it has no pad token; load it with training_core.base_model.load_tokenizer, "
                          "which pads with eos when there is none (padding is never trained), or set tokenizer.pad_token")


class SpecialTokensInText:
    """Refuses a record whose text tokenizes to a token Tessera itself puts around each example:
    a response holding eos or pad (ending in "</s>" or "<|endoftext|>") gets Tessera's eos on top,
    trained, and generation stops at the first eos, so such an example could never match; a prompt
    starting with its own "<s>" (formatted for another trainer, "<s>[INST] …") gets a second bos.
    A prompt may hold eos: an instruct model's eos is often its chat turn end (Qwen's <|im_end|>,
    Llama 3's <|eot_id|>), which closes the user turn in its chat format, and prompt tokens are
    not trained. Other special tokens (chat markers such as <|im_start|>) are left alone. Ids are
    checked, not the text: a token spelled in text that this tokenizer reads as plain text lands
    in no row as a special id. The unknown token is refused only where it is also one of these
    (GPT-2 and its kin use <|endoftext|> for unk, bos, eos and pad alike)."""

    def __init__(self, tokenizer) -> None:
        bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
        self.refused = {
            "prompt": frozenset({bos} - {eos, None}),  # bos == eos (GPT-2): a turn end there, kept
            "response": frozenset({eos, pad} - {None}),
        }
        self.tokenizer = tokenizer
        self.bos = bos

    def check(self, example: TokenizedExample, describe: Callable[[], str]) -> None:
        """Raise SourceDataError, naming the record by ``describe()``, the field and the token."""
        # The bos that opens the prompt is the one Tessera (or the chat template) put there.
        opening = int(self.bos is not None and example.prompt_ids[:1] == [self.bos])
        texts = {"prompt": example.prompt_ids[opening:], "response": example.response_ids[:-1]}
        for field, ids in texts.items():
            refused = self.refused[field]
            if refused.isdisjoint(ids):
                continue
            found = next(token for token in ids if token in refused)
            raise SourceDataError(
                f"{describe()}: its {field} holds the special token {self.tokenizer.convert_ids_to_tokens(found)!r} "
                f"(id {found}); strip it from the text: Tessera (or the chat template) puts bos before every "
                "prompt and eos after every response itself"
            )


class RowPacker:
    """Greedy in-order packing, one example at a time: completed rows are taken out as they fill,
    so memory holds one row in progress plus the rows not yet taken, never the whole dataset."""

    def __init__(self, seq_len: int, pad_token_id: int) -> None:
        if pad_token_id is None:
            raise ConfigError("pad_token_id is None: the tokenizer has no pad token; load it with "
                              "training_core.base_model.load_tokenizer, which pads with eos when there is none")
        self.seq_len, self.pad_token_id = seq_len, pad_token_id
        self._ids: list[int] = []
        self._labels: list[int] = []
        self._rows_ids: list[list[int]] = []
        self._rows_labels: list[list[int]] = []

    def add(self, example: TokenizedExample, describe: Callable[[], str]) -> None:
        """Append ``example``; ``describe()`` names it in the error when it is longer than a row."""
        check_fits(example, self.seq_len, describe)
        ids = example.prompt_ids + example.response_ids
        if len(self._ids) + len(ids) > self.seq_len:
            self._close_row()
        self._ids.extend(ids)
        self._labels.extend([IGNORE_INDEX] * len(example.prompt_ids) + example.response_ids)

    def finish(self) -> None:
        """Close the row in progress (padded), if it holds anything."""
        if self._ids:
            self._close_row()

    def take_rows(self) -> dict[str, np.ndarray]:
        """The completed rows so far as int32 arrays [rows, seq_len]; they are not returned again."""
        rows = {"input_ids": np.asarray(self._rows_ids, dtype=np.int32).reshape(-1, self.seq_len),
                "labels": np.asarray(self._rows_labels, dtype=np.int32).reshape(-1, self.seq_len)}
        self._rows_ids, self._rows_labels = [], []
        return rows

    def _close_row(self) -> None:
        padding = self.seq_len - len(self._ids)
        self._rows_ids.append(self._ids + [self.pad_token_id] * padding)
        self._rows_labels.append(self._labels + [IGNORE_INDEX] * padding)
        self._ids, self._labels = [], []


def pack_examples(
    examples: list[TokenizedExample],
    seq_len: int,
    pad_token_id: int,
    describe: Callable[[int], str] = lambda index: f"example {index}",
) -> dict[str, np.ndarray]:
    """Greedy in-order packing; returns `input_ids` and `labels` as int32 arrays [rows, seq_len].
    `describe(index)` names an example in the error for one longer than `seq_len`."""
    packer = RowPacker(seq_len, pad_token_id)
    for index, example in enumerate(examples):
        packer.add(example, lambda: describe(index))  # noqa: B023 - called at once, inside this iteration
    packer.finish()
    return packer.take_rows()
