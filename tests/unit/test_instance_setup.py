"""The local Dagster instance's settings (pipelines.instance.prepare_home): written whole or not at all,
an empty file left by an interrupted write replaced, an operator's own file kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Dies the way SIGKILL or a full disk leaves Path.write_text: the file opened (created, truncated),
# its bytes never written.
KILLED_WHILE_WRITING_SETTINGS = """
import os, pathlib, sys
real_write_text = pathlib.Path.write_text
def killed_after_open(self, *args, **kwargs):
    if self.name.startswith("dagster.yaml"):
        open(self, "w").close()
        os._exit(9)
    return real_write_text(self, *args, **kwargs)
pathlib.Path.write_text = killed_after_open
from pipelines.instance import prepare_home
prepare_home(sys.argv[1])
"""


@pytest.fixture
def state_env(monkeypatch):
    """prepare_home exports TESSERA_HOME and DAGSTER_HOME: put back what this process had."""
    monkeypatch.setenv("TESSERA_HOME", "unset-by-test")
    monkeypatch.setenv("DAGSTER_HOME", "unset-by-test")


def _loaded_settings() -> tuple[int | None, bool]:
    from pipelines.instance import load_instance

    instance = load_instance()
    try:
        return instance.get_concurrency_config().pool_config.default_pool_limit, instance.telemetry_enabled
    finally:
        instance.dispose()


def test_a_write_killed_midway_leaves_no_short_dagster_yaml_and_the_next_run_writes_it(tmp_path, state_env):
    from pipelines.instance import INSTANCE_SETTINGS, prepare_home

    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_WRITING_SETTINGS, str(tmp_path)], cwd=REPO,
                            timeout=120)
    assert killed.returncode == 9
    settings = tmp_path / "dagster" / "dagster.yaml"
    assert not settings.exists()  # Dagster would load a short one silently: no pool limit, telemetry on
    prepare_home(str(tmp_path))
    assert settings.read_text() == INSTANCE_SETTINGS
    assert _loaded_settings() == (1, False)


@pytest.mark.parametrize("left_behind", ["", "\n"])
def test_an_empty_dagster_yaml_is_written_again_with_the_training_pool_limit(tmp_path, state_env, caplog,
                                                                               left_behind):
    from pipelines.instance import INSTANCE_SETTINGS, prepare_home

    settings = tmp_path / "dagster" / "dagster.yaml"
    settings.parent.mkdir(parents=True)
    settings.write_text(left_behind)  # an earlier version killed mid-write, or a power loss
    prepare_home(str(tmp_path))
    assert settings.read_text() == INSTANCE_SETTINGS
    assert f"{settings} is empty" in caplog.text
    assert _loaded_settings() == (1, False)


@pytest.mark.parametrize("own", [
    "telemetry:\n  enabled: true\n",  # valid: the operator's choice, no pool limit
    "# settings come later\n",
    "concurrency: [oops\n",  # damaged: named by load_instance, not overwritten
])
def test_an_operators_own_dagster_yaml_is_kept_as_it_is(tmp_path, state_env, own):
    from pipelines.instance import prepare_home

    settings = tmp_path / "dagster" / "dagster.yaml"
    settings.parent.mkdir(parents=True)
    settings.write_text(own)
    prepare_home(str(tmp_path))
    assert settings.read_text() == own
    assert [p.name for p in settings.parent.iterdir()] == ["dagster.yaml"]


def test_training_cores_info_lines_reach_the_runs_dagster_log_once_on_the_terminal(tmp_path, state_env):
    """Which MLflow run a step started or reused is an INFO line of training_core: the instance hands it
    to the run's Dagster log (the UI shows it), and the CLI's own handler leaves it to Dagster's printing."""
    import logging

    import dagster as dg

    from pipelines.cli import _not_shown_by_dagster
    from pipelines.instance import load_instance, prepare_home

    @dg.asset
    def trained():
        logging.getLogger("training_core.runs").info("MLflow run abc123 started")
        logging.getLogger("elsewhere").warning("a line of another library")

    printed: list[str] = []
    terminal = logging.Handler(logging.INFO)
    terminal.emit = lambda record: printed.append(record.getMessage())
    terminal.addFilter(_not_shown_by_dagster)
    root = logging.getLogger()
    root.addHandler(terminal)
    prepare_home(str(tmp_path))
    instance = load_instance()
    try:
        run_id = dg.materialize([trained], instance=instance).run_id
        logged = [entry.user_message for entry in instance.all_logs(run_id)]
    finally:
        root.removeHandler(terminal)
        instance.dispose()
    assert [message for message in logged if "abc123" in message] == ["MLflow run abc123 started"]
    assert not any("another library" in message for message in logged)
    assert [message for message in printed if "abc123" in message or "another library" in message] == [
        "a line of another library"]


def test_the_daemon_frees_the_pool_slots_that_ended_runs_still_hold(tmp_path, state_env):
    """dagster dev's code server marks a run it launched whose process was killed FAILURE without freeing its
    training slot: Dagster's daemon frees it only where the instance asks it to."""
    from pipelines.instance import load_instance, prepare_home

    prepare_home(str(tmp_path))
    instance = load_instance()
    try:
        assert instance.run_monitoring_settings["free_slots_after_run_end_seconds"] == 30
        assert instance.run_monitoring_enabled
    finally:
        instance.dispose()
