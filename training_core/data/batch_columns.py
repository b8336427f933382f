"""Columns of a packed training dataset, as the loader and the training loop read them."""

TRAINING_COLUMNS = ["input_ids", "labels"]
TRAINING_TRANSFORM_VERSION = "none"  # training reads the columns as stored: no transform
