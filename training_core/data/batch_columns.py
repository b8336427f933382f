"""Columns of a packed training dataset, as the loader and the training loop read them."""

TRAINING_COLUMNS = ["input_ids", "labels"]
