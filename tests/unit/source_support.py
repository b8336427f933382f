"""Source records as lists, for tests: Tessera itself streams them (sources.iter_records)."""

from __future__ import annotations

from pathlib import Path

from training_core.data.sources import RecordOrigins, iter_records


def read_records(source: str | Path) -> list[dict[str, str]]:
    """All records from every data file at `source`, in file order."""
    return list(iter_records(source))


def read_records_with_origins(source: str | Path) -> tuple[list[dict[str, str]], RecordOrigins]:
    """All records from every data file at `source`, in file order, and where each came from."""
    origins = RecordOrigins()
    return list(iter_records(source, origins)), origins
