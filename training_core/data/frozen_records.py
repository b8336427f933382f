"""A day's source records frozen as read: `records.jsonl` under a content-digest folder, published
atomically, so that a training dataset (and every error naming a record's line) refers to records
that never change, whatever later happens to the user's source."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from training_core.data.sources import ORIGINS_FILE, RecordOrigins
from training_core.storage import directory_digest, publish_directory, staging_directory

RECORDS_FILE = "records.jsonl"


@dataclass(frozen=True)
class FrozenRecords:
    folder: Path
    digest: str  # over records.jsonl only: the origins are hidden, like the file digests

    @property
    def path(self) -> Path:
        return self.folder / RECORDS_FILE


def freeze_records(records: list[dict[str, str]], origins: RecordOrigins | None, root: Path) -> FrozenRecords:
    """Publish ``records`` as ``root/<digest>/records.jsonl``, one JSON object a line in order, with
    ``origins`` (where each record was in the user's files) beside it, so later errors name them."""
    with staging_directory(root) as staging:
        with (staging / RECORDS_FILE).open("w", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        digest = directory_digest(staging, record_files=True)
        if origins is not None:
            origins.save(staging / ORIGINS_FILE)
        final = publish_directory(staging, root / digest[:16])
    if origins is not None and RecordOrigins.load(final / ORIGINS_FILE) != origins:
        # The same records published earlier from another file: later errors must name today's source.
        origins.save(final / ORIGINS_FILE)
    return FrozenRecords(final, digest)
