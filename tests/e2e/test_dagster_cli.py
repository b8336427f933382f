"""Dagster's own command line on the code location: `dagster asset materialize` (what a cron job or
a CI pipeline outside the UI runs) writes the same state as the UI and `tessera demo`."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.storage.dagster_run import DagsterRun

from pipelines.instance import LAUNCHER_TAG, fail_abandoned_runs

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "TESSERA_HOME": str(home), "DAGSTER_HOME": str(home / "dagster")}


def _dagster(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dagster", *args], cwd=REPO, env=_env(home), capture_output=True,
                          text=True, timeout=600)


def _prepare(home: Path) -> None:
    prepared = subprocess.run([sys.executable, "-m", "pipelines.instance", str(home)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)  # as README says, once per state folder
    assert prepared.returncode == 0, prepared.stderr


def test_dagster_asset_materialize_builds_a_days_dataset_and_names_what_training_still_needs(tmp_path):
    _prepare(tmp_path)
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


def _kill_when(home: Path, started: Callable[[], bool], *select: str) -> None:
    """Run `dagster asset materialize` for 2026-11-02 and kill its process (SIGKILL, as a machine restart
    would) once ``started()`` says the run has reached the point under test."""
    with open(home / "dagster.log", "w+") as log:
        launched = subprocess.Popen(
            [sys.executable, "-m", "dagster", "asset", "materialize", "-m", "pipelines.definitions", "--partition",
             "2026-11-02", *select], cwd=REPO, env=_env(home), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.monotonic() + 300
        try:
            while not started():  # each check waits up to half a second
                if launched.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise AssertionError(f"the run exited ({launched.returncode}) or did not get there in 300 s: "
                                         f"{log.read()[-3000:]}")
        finally:
            with contextlib.suppress(ProcessLookupError):  # a run that exited by itself: its group is gone
                os.killpg(launched.pid, signal.SIGKILL)
            launched.wait()


def test_a_cli_run_killed_in_its_first_step_is_failed_by_the_next_sweep(tmp_path):
    """Only the training step used to record the run's process: a run killed before it (a machine restarted
    while the day's data was read or its cache warmed) stayed STARTED for ever, and the schedule waited behind
    its day. Here the process is killed while raw_examples waits on a source that never answers."""
    from tests.silent_server import silent_http_server

    _prepare(tmp_path)
    with silent_http_server() as source:
        run_config = tmp_path / "run.yaml"
        run_config.write_text(json.dumps({"ops": {"raw_examples": {"config": {"source": f"{source.url}/day.jsonl"}}}}))
        _kill_when(tmp_path, lambda: source.connected.wait(timeout=0.5), "--select", "raw_examples",
                   "-c", str(run_config))
    with dg.DagsterInstance.from_config(str(tmp_path / "dagster")) as instance:
        [killed] = instance.get_runs()
        assert killed.status == dg.DagsterRunStatus.STARTED  # Dagster alone never learns the process is gone
        assert fail_abandoned_runs(instance) == [killed.run_id]
        assert instance.get_run_by_id(killed.run_id).status == dg.DagsterRunStatus.FAILURE


def test_a_training_run_killed_while_it_waits_for_the_pool_slot_gives_up_its_place(tmp_path):
    """A run of lora_adapter alone starts no step until it holds the training pool's slot. Killed while it
    waited, it had no launcher tag, stayed STARTED, and the slot Dagster hands to the oldest waiting step went
    to it when the holder finished: no training ran again until someone terminated the run by hand."""
    from training_core.process_identity import this_process

    _prepare(tmp_path)
    with dg.DagsterInstance.from_config(str(tmp_path / "dagster")) as instance:
        storage = instance.event_log_storage
        storage.set_concurrency_slots("training", 1)  # as the instance's default_limit sets it on first use
        instance.add_run(DagsterRun(job_name="__ASSET_JOB", run_id="training-now", status=dg.DagsterRunStatus.STARTED,
                                    tags={LAUNCHER_TAG: this_process()}))  # a live run holds the slot
        assert storage.claim_concurrency_slot("training", "training-now", "lora_adapter").is_claimed

        def waiting_for_the_slot() -> bool:
            waiting = bool(storage.get_concurrency_info("training").pending_run_ids)
            if not waiting:
                time.sleep(0.5)  # the poll interval while the CLI imports and starts the run
            return waiting

        _kill_when(tmp_path, waiting_for_the_slot, "--select", "lora_adapter")
        [killed] = [run for run in instance.get_runs() if run.run_id != "training-now"]
        assert storage.get_concurrency_info("training").pending_run_ids == {killed.run_id}
        assert fail_abandoned_runs(instance) == [killed.run_id]
        storage.free_concurrency_slots_for_run("training-now")  # the holder finishes
        assert storage.claim_concurrency_slot("training", "next-run", "lora_adapter").is_claimed
