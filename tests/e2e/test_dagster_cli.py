"""Dagster's own command line on the code location: `dagster asset materialize` (what a cron job or
a CI pipeline outside the UI runs) writes the same state as the UI and `tessera demo`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def _dagster(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TESSERA_HOME": str(home), "DAGSTER_HOME": str(home / "dagster")}
    return subprocess.run([sys.executable, "-m", "dagster", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def test_dagster_asset_materialize_builds_a_days_dataset_and_names_what_training_still_needs(tmp_path):
    prepared = subprocess.run([sys.executable, "-m", "pipelines.instance", str(tmp_path)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)  # as README says, once per state folder
    assert prepared.returncode == 0, prepared.stderr
    done = _dagster(tmp_path, "asset", "materialize", "-m", "pipelines.definitions", "--partition", "2026-11-02",
                    "--select", "raw_examples,base_model,training_dataset,row_group_cache")
    assert done.returncode == 0, done.stderr[-3000:]
    datasets = list((tmp_path / "datasets" / "training" / "2026-11-02").iterdir())
    assert len(datasets) == 1 and (datasets[0] / "manifest.json").is_file()
    assert json.loads((datasets[0] / "manifest.json").read_text())["train_rows"] > 0
    assert (tmp_path / "cache" / "row_groups").is_dir()

    # Training for 2026-11-02 reads the window 2026-11-01..02; the first day was never built here.
    done = _dagster(tmp_path, "asset", "materialize", "-m", "pipelines.definitions", "--partition", "2026-11-02",
                    "--select", "lora_adapter")
    assert done.returncode != 0
    assert ("input 'row_group_cache' needs row_group_cache partition 2026-11-01, which has not been materialized "
            "here") in done.stderr
