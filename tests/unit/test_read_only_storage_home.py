"""A read-only state folder given as storage.home in a run's config is refused as the run starts, naming
the setting: steps failed one by one on a bare "Read-only file system" in models/base/.staging-…
(the CLI and `python -m pipelines.instance` refuse one before that: test_read_only_state_folder.py)."""

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from resources import paths
from resources.paths import TesseraStorage

from .test_read_only_state_folder import _writes_through_permission_bits

REPO = Path(__file__).resolve().parents[2]

# A run whose storage.home (run config) is the folder given, as a UI launch sets it.
RUN_WITH_STORAGE_HOME = """
import sys
import dagster as dg
from pipelines.resources_local import local_resources
from resources import TesseraStorage

@dg.asset
def writes_a_model(storage: TesseraStorage) -> None:
    (storage.folder("models") / "weights").write_text("")

result = dg.materialize([writes_a_model], resources={"storage": local_resources(storage_set_at_launch=True)["storage"]},
                        run_config={"resources": {"storage": {"config": {"home": sys.argv[1]}}}}, raise_on_error=False)
cause = result.get_run_failure_event().event_specific_data.error.cause if not result.success else None
print("steps run:", [event.step_key for event in result.get_step_success_events()])
print("refused:", cause.message.strip() if cause else None)
"""


def _refusal(root: Path, path: Path, why: str) -> str:
    """The run failure's cause, as Dagster records it (class, then message)."""
    return (f"training_core.errors.ConfigError: state folder {root} is read-only ({path} is {why}); make it "
            "writable, or use a writable state folder (storage.home / TESSERA_HOME)")


def _run_with_storage_home(home: Path, *wrapper: str) -> list[str]:
    done = subprocess.run([*wrapper, sys.executable, "-c", RUN_WITH_STORAGE_HOME, str(home)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TESSERA_HOME": "unused"})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-2:]


@pytest.fixture
def populated_home(tmp_path) -> Path:
    home = tmp_path / "state"
    for name in ("datasets", "cache", "models", "ray", "mlartifacts"):
        (home / name).mkdir(parents=True)
    return home


def _can_mount_read_only(folder: Path) -> bool:
    """Whether this process may bind-mount a folder read-only in a mount namespace of its own (root
    with CAP_SYS_ADMIN; not in most unprivileged containers)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0"',
                            str(folder)], capture_output=True)
    return probe.returncode == 0


def test_a_read_only_mount_as_storage_home_is_refused_before_any_step(populated_home):
    if not _can_mount_read_only(populated_home):
        pytest.skip("no mount namespace for this process: a read-only mount cannot be made")
    mounted_read_only = ["unshare", "-m", "sh", "-c",
                         'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"', str(populated_home)]
    assert _run_with_storage_home(populated_home, *mounted_read_only) == [
        "steps run: []", f"refused: {_refusal(populated_home, populated_home / 'datasets', 'on a read-only file system')}"]


@pytest.mark.skipif(_writes_through_permission_bits(),
                    reason="this process (root) writes through permission bits: nothing to refuse")
def test_a_storage_home_this_user_cannot_write_is_refused_before_any_step(populated_home):
    models = populated_home / "models"
    models.chmod(models.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        assert _run_with_storage_home(populated_home) == [
            "steps run: []", f"refused: {_refusal(populated_home, models, 'not writable by this user')}"]
    finally:
        models.chmod(models.stat().st_mode | stat.S_IWUSR)


@pytest.mark.parametrize("name", ["datasets", "cache", "models", "ray", "mlartifacts", "mlflow.db"])
def test_the_storage_resource_asks_the_os_about_each_folder_a_run_writes(populated_home, monkeypatch, name):
    """Runs with or without permission bits that bind (as root too): the OS's answer for one folder is
    replaced by "not writable", which is what os.access says of a read-only mount or a folder of another user."""
    (populated_home / "mlflow.db").touch()
    not_writable = populated_home / name
    real_access = os.access
    monkeypatch.setattr(paths.os, "access", lambda path, mode: Path(path) != not_writable and real_access(path, mode))

    @dg.asset
    def writes_state(storage: TesseraStorage) -> None:
        storage.folder("datasets")

    result = dg.materialize([writes_state], resources={"storage": TesseraStorage(home=str(populated_home))},
                            raise_on_error=False)
    assert not result.success and result.get_step_success_events() == []
    cause = result.get_run_failure_event().event_specific_data.error.cause
    assert cause.message.strip() == _refusal(populated_home, not_writable, "not writable by this user")


def test_a_read_only_root_with_writable_folders_still_runs(populated_home, monkeypatch):
    """A volume whose root cannot be written, its subfolders can (test_operator_errors.py): not refused."""
    real_access = os.access
    monkeypatch.setattr(paths.os, "access", lambda path, mode: Path(path) != populated_home and real_access(path, mode))

    @dg.asset
    def writes_state(storage: TesseraStorage) -> None:
        storage.folder("datasets")

    assert dg.materialize([writes_state], resources={"storage": TesseraStorage(home=str(populated_home))}).success
