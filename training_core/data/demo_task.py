"""The demo instruction task: a letter-substitution cipher that a tiny model can learn on a CPU.

Each record asks to encode a short lowercase word with a fixed substitution (each letter shifted
by `SHIFT` places). The answer is never a copy of the prompt, and held-out prompts are words the
model has not seen, so exact-match measures a learned rule rather than memorised rows.
Records are a pure function of the partition key: the same day always yields the same rows.
"""

from __future__ import annotations

import hashlib
import string

import numpy as np

ALPHABET = string.ascii_lowercase
SHIFT = 3
WORD_LENGTH = 4
PROMPT_PREFIX = "encode:"
# Words are drawn with replacement from 26**4 = 456,976: past about 45,000 records a day, more than
# 5 % repeat an earlier one and the day fails its own blocking no_duplicate_rows check (at 40,000
# about 4.2 % repeat). More data for the demo: more days.
MAX_RECORDS_PER_PARTITION = 40_000


def encode_word(word: str) -> str:
    return "".join(ALPHABET[(ALPHABET.index(letter) + SHIFT) % len(ALPHABET)] for letter in word)


def make_record(word: str) -> dict[str, str]:
    """Letters are space-separated so that every letter is one token for any tokenizer."""
    return {"prompt": f"{PROMPT_PREFIX} {' '.join(word)}", "response": " ".join(encode_word(word))}


def partition_seed(partition_key: str, seed: int = 0) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{partition_key}".encode()).digest()[:8], "little")


def generate_records(partition_key: str, num_records: int, seed: int = 0) -> list[dict[str, str]]:
    """`num_records` records for one partition, deterministic in (partition_key, seed)."""
    if not 0 <= num_records <= MAX_RECORDS_PER_PARTITION:
        raise ValueError(f"num_records must be between 0 and {MAX_RECORDS_PER_PARTITION:,} (more would repeat over "
                         f"5 % of the demo's {len(ALPHABET)}**{WORD_LENGTH} words), got {num_records}")
    rng = np.random.default_rng(partition_seed(partition_key, seed))
    letters = rng.integers(0, len(ALPHABET), size=(num_records, WORD_LENGTH))
    return [make_record("".join(ALPHABET[i] for i in row)) for row in letters]


def tokenizer_corpus() -> list[str]:
    """Every token the task can produce, for training the demo tokenizer."""
    return [f"{PROMPT_PREFIX} {' '.join(ALPHABET)}", " ".join(ALPHABET)]
