"""A state folder that holds state but cannot be written (a read-only mount, a copy owned by someone
else) is refused in one line naming it, before Dagster, MLflow or Ray touch it: Dagster's SQLite said
"unable to open database file" and blamed dagster.yaml, `tessera reproduce` started Ray and then
failed in an MLflow autoflush traceback."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _writes_through_permission_bits() -> bool:
    """Root (CAP_DAC_OVERRIDE) writes into a folder chmod-ed read-only, so chmod cannot make one for it
    (a read-only mount can, but needs mount privileges)."""
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o555)
        try:
            Path(folder, "probe").touch()
            return True
        except PermissionError:
            return False
        finally:
            os.chmod(folder, 0o755)


pytestmark = pytest.mark.skipif(_writes_through_permission_bits(),
                                reason="this process (root) writes through permission bits: nothing to refuse")


@pytest.fixture
def state_env(monkeypatch):
    """prepare_home exports TESSERA_HOME and DAGSTER_HOME: put back what this process had."""
    monkeypatch.setenv("TESSERA_HOME", "unset-by-test")
    monkeypatch.setenv("DAGSTER_HOME", "unset-by-test")


@pytest.fixture
def populated_state(tmp_path, state_env) -> Path:
    """A state folder with a Dagster instance and an MLflow store, as a demo leaves it."""
    from pipelines.instance import load_instance, prepare_home

    root = prepare_home(str(tmp_path / "state"))
    load_instance().dispose()  # Dagster's SQLite stores under dagster/
    with sqlite3.connect(root / "mlflow.db") as store:
        store.execute("CREATE TABLE runs (run_uuid TEXT)")
    yield root
    _set_writable(root, True)  # so pytest can remove it


def _set_writable(root: Path, writable: bool) -> None:
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode | stat.S_IWUSR if writable else mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _refusal(root: Path, path: Path) -> str:
    return (f"state folder {root} is read-only ({path} is not writable by this user); make it writable, or use a "
            "writable state folder (--home / TESSERA_HOME)")


@pytest.mark.parametrize("command", [["demo"], ["free-slots"], ["reproduce", "0123456789abcdef0123456789abcdef"]])
def test_the_cli_refuses_a_read_only_state_folder_in_one_line(populated_state, capsys, command):
    from pipelines.cli import main

    _set_writable(populated_state, False)
    assert main([*command, "--home", str(populated_state)]) == 2
    assert capsys.readouterr().err == f"tessera {command[0]}: {_refusal(populated_state, populated_state)}\n"


def test_preparing_the_instance_refuses_a_read_only_state_folder_in_one_line(populated_state):
    _set_writable(populated_state, False)
    prepared = subprocess.run([sys.executable, "-m", "pipelines.instance", str(populated_state)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
    assert prepared.returncode == 2
    assert prepared.stdout == ""
    assert prepared.stderr == f"python -m pipelines.instance: {_refusal(populated_state, populated_state)}\n"


@pytest.mark.parametrize("read_only", ["dagster", "mlflow.db"])
def test_a_read_only_dagster_folder_or_mlflow_store_is_named(populated_state, read_only):
    from pipelines.instance import prepare_home
    from training_core.errors import ConfigError

    target = populated_state / read_only
    target.chmod(target.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    with pytest.raises(ConfigError) as refused:
        prepare_home(str(populated_state))
    assert str(refused.value) == _refusal(populated_state, target)
