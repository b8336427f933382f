"""Data: source records, packing and publication, and the row-group reader (DESIGN.md contract)."""

from training_core.data.cache import CacheConfig, CacheWarmReport, cache_version, warm_cache
from training_core.data.reader import RowGroupReader
from training_core.data.stats import ReaderStats
from training_core.data.torch_batches import batch_to_torch

__all__ = [
    "CacheConfig",
    "CacheWarmReport",
    "ReaderStats",
    "RowGroupReader",
    "batch_to_torch",
    "cache_version",
    "warm_cache",
]
