"""Fixtures for the unit tests: small Parquet datasets with known row ids, MLflow runs deleted for good."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def write_ids_dataset(directory: Path, layout: list[tuple[int, int]], token_width: int = 4) -> Path:
    """Write one file per ``(rows, row_group_size)`` with a global ``id`` and ``id``-derived tokens."""
    directory.mkdir(parents=True, exist_ok=True)
    offset = 0
    for index, (rows, row_group_size) in enumerate(layout):
        ids = np.arange(offset, offset + rows, dtype=np.int64)
        tokens = (ids[:, None] * 10 + np.arange(token_width)).astype(np.int32)
        table = pa.table({
            "id": ids,
            "tokens": pa.FixedSizeListArray.from_arrays(tokens.ravel(), token_width).cast(pa.list_(pa.int32())),
        })
        pq.write_table(table, directory / f"part-{index:03d}.parquet", row_group_size=row_group_size)
        offset += rows
    return directory


def read_ids(source, **kwargs) -> list[np.ndarray]:
    """Every batch's ``id`` column, in order, from a fresh RowGroupReader over ``source``."""
    from training_core.data import RowGroupReader

    with RowGroupReader(source, **kwargs) as reader:
        return [batch["id"].copy() for batch in reader]


@pytest.fixture
def ids_dataset(tmp_path: Path) -> Path:
    """1 000 rows in 3 files with uneven row groups (130, 200, 7 rows)."""
    return write_ids_dataset(tmp_path / "ids", [(600, 130), (350, 200), (50, 7)])


def garbage_collect_run(tracking_uri: str, run_id: str) -> None:
    """Delete an MLflow run for good, as an operator does: delete it, then `mlflow gc` (in its own
    process: the command sets the tracking URI of the process it runs in)."""
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri).delete_run(run_id)
    gc = subprocess.run([sys.executable, "-m", "mlflow", "gc", "--backend-store-uri", tracking_uri,
                         "--tracking-uri", tracking_uri, "--run-ids", run_id], capture_output=True, text=True)
    assert gc.returncode == 0, gc.stderr


def entry(seed: int, rows: int = 1000) -> dict[str, np.ndarray]:
    """~100 kB, stored as a file; the int32 extremes keep it from being narrowed."""
    values = np.full((rows, 25), seed, dtype=np.int32)
    values[:, 1], values[:, 2] = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    return {"x": values}


def stored_entry(key: str, arrays: dict[str, np.ndarray]) -> tuple:
    """``(key, narrowed columns, logical dtypes)``, as the reader hands entries to ``put_many``."""
    from training_core.data.cache_payload import narrow_columns

    return key, narrow_columns(arrays), {name: array.dtype for name, array in arrays.items()}
