"""Columns of a packed training dataset, as the loader and the training loop read them, and what training
does to each decoded row group. Cache warming (row_group_cache), training (EpochBatches), the stale-cache
check (DatasetWindow) and reproduce all take them from here: the cache warmed is the one training reads
and the cache version a reproduction rebuilds."""

TRAINING_COLUMNS = ["input_ids", "labels"]
# Training reads the columns as stored: no transform. A transform set here needs a new version with it:
# the version is part of every cache key and of the cache version, so rows stored by another transform
# are never served.
TRAINING_TRANSFORM = None
TRAINING_TRANSFORM_VERSION = "none"
