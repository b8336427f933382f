"""What every step of the graph does before any work: refuse a run with invalid settings, then record
the run's process, so a run killed at any step (a machine restart while the cache warms, not only
mid-training) can be told from a live one and failed by the next sweep (`pipelines.instance`)."""

from __future__ import annotations

import dagster as dg

from assets.launch_checks import refuse_invalid_run_config
from assets.run_identity import record_this_process


def start_step(context: dg.AssetExecutionContext) -> None:
    """Call first in each asset."""
    refuse_invalid_run_config(context)
    record_this_process(context)
