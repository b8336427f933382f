"""Dagster assets: thin wrappers that parse config, call training_core, and return metadata."""

import warnings

import dagster as dg

# Data versions (content digests on Output) are how Tessera tracks staleness; Dagster marks the
# parameter beta. Silence that one warning instead of repeating it in every run's log.
warnings.filterwarnings("ignore", category=dg.BetaWarning, message=".*data_version.*")
