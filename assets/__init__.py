"""Dagster assets: thin wrappers that parse config, call training_core, and return metadata."""
