"""A day's source records frozen as read: `records.jsonl` under a content-digest folder, published
atomically, so that a training dataset (and every error naming a record's line) refers to records
that never change, whatever later happens to the user's source."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from training_core.data.sources import ORIGINS_FILE, RecordOrigins
from training_core.errors import EmptyPartitionError
from training_core.storage import directory_digest, file_digest, publish_directory, staging_directory

RECORDS_FILE = "records.jsonl"


@dataclass(frozen=True)
class FrozenRecords:
    folder: Path
    digest: str  # over records.jsonl only: the origins are hidden, like the file digests
    records: int  # how many were written

    @property
    def path(self) -> Path:
        return self.folder / RECORDS_FILE


def freeze_records(records: Iterable[dict[str, str]], origins: RecordOrigins | None, root: Path,
                   *, source_label: str = "the source") -> FrozenRecords:
    """Publish ``records`` as ``root/<digest>/records.jsonl``, one JSON object a line in order, with
    ``origins`` (where each record was in the user's files) beside it, so later errors name them.

    ``records`` may be a one-pass iterator (`sources.iter_records` filling ``origins`` as it goes):
    they are written as they come, so memory holds one record, not the day. A source error part way
    leaves nothing published; no records at all raise `EmptyPartitionError` before anything is
    written (``source_label`` names the source in its message)."""
    records = iter(records)
    first = next(records, None)
    if first is None:
        raise EmptyPartitionError(f"{source_label} has no records")
    count = 0
    with staging_directory(root) as staging:  # removed, unpublished, when reading fails part way
        with (staging / RECORDS_FILE).open("w", encoding="utf-8") as handle:
            for record in itertools.chain([first], records):
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
                count += 1
        digest = directory_digest(staging, record_files=True)
        if origins is not None:
            origins.save(staging / ORIGINS_FILE)
            staged_origins = _file_digest(staging / ORIGINS_FILE)
        final = publish_directory(staging, root / digest[:16])
    if origins is not None and _file_digest(final / ORIGINS_FILE) != staged_origins:
        # The same records published earlier from another file: later errors must name today's source.
        origins.save(final / ORIGINS_FILE)
    return FrozenRecords(final, digest, count)


def _file_digest(path: Path) -> str | None:
    """None when the file cannot be read (no origins kept there)."""
    try:
        return file_digest(path)
    except OSError:
        return None


def read_frozen_record(records_path: str | Path, index: int) -> dict[str, str]:
    """Record ``index`` (0-based: line ``index + 1``) of a frozen records file, found by reading the
    file up to it: for the few records an error message names, never for every record."""
    with open(records_path, encoding="utf-8", newline="\n") as handle:
        for line in itertools.islice(handle, index, index + 1):
            return json.loads(line)
    raise IndexError(f"{records_path} has no line {index + 1}")
