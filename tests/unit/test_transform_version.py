"""TRAINING_TRANSFORM / TRAINING_TRANSFORM_VERSION (training_core/data/batch_columns.py) are the one place
to change training's row transform: cache warming, training, the stale-cache check and reproduce follow."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROWS, SEQ, DAY = 64, 8, "2026-11-01"


def _bump_training_transform(monkeypatch, transform, version: str) -> None:
    """What editing batch_columns.py does: every module that imported the transform or its version
    (reproduce imports the version as TRANSFORM_VERSION) sees the new one."""
    import assets.cache_assets  # noqa: F401 - the modules that read it, imported before the edit
    import training_core.data.window  # noqa: F401
    import training_core.reproduce  # noqa: F401
    import training_core.train.batches  # noqa: F401

    bumped = {"TRAINING_TRANSFORM": transform, "TRAINING_TRANSFORM_VERSION": version, "TRANSFORM_VERSION": version}
    for module in [m for name, m in sys.modules.items() if name.split(".")[0] in ("assets", "training_core")]:
        for name, value in bumped.items():
            if name in vars(module):
                monkeypatch.setattr(module, name, value)


def _next_labels(columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**columns, "labels": columns["labels"] + 1}


@pytest.fixture()
def published(tmp_path: Path):
    from training_core.data.dataset_writer import PublishedDataset

    tokens = np.arange(ROWS * SEQ, dtype=np.int32).reshape(ROWS, SEQ)
    column = pa.FixedSizeListArray.from_arrays(pa.array(tokens.ravel()), SEQ)
    (tmp_path / "dataset" / "train").mkdir(parents=True)
    pq.write_table(pa.table({"input_ids": column, "labels": column}), tmp_path / "dataset" / "train" / "part-0.parquet",
                   row_group_size=16)
    return PublishedDataset(str(tmp_path / "dataset"), "d" * 64, ROWS, ROWS, 0, ROWS // 16, 1, SEQ, ROWS * SEQ)


def test_a_bumped_transform_version_is_warmed_read_checked_and_rebuilt_alike(tmp_path, monkeypatch, published):
    import dagster as dg

    from assets.cache_assets import row_group_cache
    from resources import RowGroupCache, TesseraStorage
    from training_core import reproduce
    from training_core.data import cache_version
    from training_core.data.batch_columns import TRAINING_COLUMNS
    from training_core.data.window import DatasetWindow, window_digest
    from training_core.train.batches import EpochBatches
    from training_core.train.config import TrainingConfig

    _bump_training_transform(monkeypatch, _next_labels, "next-labels-v2")
    cache = RowGroupCache(storage=TesseraStorage(home=str(tmp_path / "home")))
    warmed = row_group_cache(dg.build_asset_context(partition_key=DAY), storage=cache.storage, cache=cache,
                             training_dataset=published).value

    assert warmed.cache_version == cache_version(published.digest, TRAINING_COLUMNS, "next-labels-v2")
    assert DatasetWindow.from_partitions({DAY: published}).stale_caches({DAY: warmed.cache_version}) == []
    # What lora_adapter records, and what reproduce rebuilds from the dataset digests
    assert window_digest([warmed.cache_version]) == window_digest(
        [cache_version(published.digest, TRAINING_COLUMNS, reproduce.TRANSFORM_VERSION)])

    # Training reads every row group from the entries warming stored, transformed as warming did.
    inputs = SimpleNamespace(train_dirs=[str(published.train_dir)], cache_dir=warmed.directory,
                             cache_size_limit_bytes=cache.size_limit_bytes, cache_policy=cache.policy)
    batches = EpochBatches(inputs, TrainingConfig(num_workers=1, micro_batch_size=16, max_epochs=1), 0, 1, 0, None)
    try:
        while (batch := batches.next()) is not None:
            assert (batch["labels"] == batch["input_ids"] + 1).all()
        assert (batches.stats()["cache_hits"], batches.stats()["cache_misses"]) == (ROWS // 16, 0)
    finally:
        batches.close()
