"""A Ray worker refuses to train when it runs other code or libraries than the driver recorded in
the run's lineage: the comparison, and what each worker computes from the sources it imports (a
copy on PYTHONPATH, as a worker of a cluster on another image or checkout does)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from training_core.errors import LineageError
from training_core.lineage import CODE_PACKAGES, REPO_ROOT, build_lineage_record
from training_core.train.worker_code import CodeIdentity, refuse_other_code

VERSIONS = {"version_torch": "2.5.1", "version_numpy": "2.1.0"}
RECORDED = CodeIdentity("a" * 40, "1" * 12, VERSIONS, "e" * 16)


def test_a_worker_running_the_recorded_code_trains():
    refuse_other_code(RECORDED, rank=0, running=CodeIdentity("a" * 40, "1" * 12, dict(VERSIONS), "e" * 16))
    # the same files seen otherwise by git (staged or committed since, or an image without .git)
    refuse_other_code(RECORDED, rank=0, running=CodeIdentity("abc123+src-111111111111", "1" * 12, VERSIONS, "e" * 16))


def test_other_code_is_refused_naming_both_versions_and_the_fix():
    running = CodeIdentity("b" * 40 + "-dirty-0123456789ab", "2" * 12, VERSIONS, "e" * 16)
    with pytest.raises(LineageError) as refused:
        refuse_other_code(RECORDED, rank=1, running=running)
    message = str(refused.value)
    assert f"training rank 1 on {os.uname().nodename}" in message
    assert (f"code: {'a' * 40}, sources {'1' * 12} (recorded) ≠ {'b' * 40}-dirty-0123456789ab, sources {'2' * 12} "
            "(this worker)") in message
    assert "redeploy or restart it with the code location's image" in message


def test_other_library_versions_are_refused_naming_each_package():
    running = CodeIdentity("a" * 40, "1" * 12,
                           {"version_torch": "2.6.0", "version_numpy": "2.1.0", "version_peft": "0.13"}, "f" * 16)
    with pytest.raises(LineageError) as refused:
        refuse_other_code(RECORDED, rank=0, running=running)
    message = str(refused.value)
    assert "version_torch: 2.5.1 (recorded) ≠ 2.6.0 (this worker)" in message
    assert "version_peft: not recorded (recorded) ≠ 0.13 (this worker)" in message
    assert "version_numpy" not in message and "code:" not in message
    assert f"environment_digest {'e' * 16} (recorded) vs {'f' * 16} (this worker)" in message


def test_the_drivers_lineage_record_matches_a_worker_in_its_environment():
    """In-process Ray: workers import the driver's sources and libraries, so nothing is refused."""
    lineage = build_lineage_record(
        seed=0, data_seed=0, dataset_digest="d", dataset_paths=[], cache_version="c", base_model="m",
        base_model_digest="b", config_digest="x", dagster_run_id="", partition_keys=[])
    recorded = CodeIdentity.from_lineage(lineage)
    assert recorded == CodeIdentity.of_this_process()
    refuse_other_code(recorded, rank=0)


def _copy_sources(destination: Path, change: str = "") -> Path:
    """Tessera's code as an image holds it: the packages and pyproject.toml, without .git."""
    destination.mkdir()
    shutil.copy2(REPO_ROOT / "pyproject.toml", destination / "pyproject.toml")
    for package in CODE_PACKAGES:
        shutil.copytree(REPO_ROOT / package, destination / package, ignore=shutil.ignore_patterns("__pycache__", "results"))
    if change:
        with (destination / "training_core" / "data" / "order.py").open("a") as file:
            file.write(change)
    return destination


def _worker_check(sources: Path, recorded: CodeIdentity) -> subprocess.CompletedProcess:
    """What a worker importing Tessera from `sources` (first on its PYTHONPATH) decides."""
    script = (
        "import json, sys\n"
        "from training_core.lineage import REPO_ROOT\n"
        "from training_core.train.worker_code import CodeIdentity, refuse_other_code\n"
        f"assert REPO_ROOT == __import__('pathlib').Path({str(sources)!r}), REPO_ROOT\n"
        "refuse_other_code(CodeIdentity(**json.loads(sys.argv[1])), rank=0)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(sources), "TESSERA_CODE_VERSION": "abc123"}
    return subprocess.run([sys.executable, "-c", script, json.dumps(recorded.as_dict())], env=env, cwd=sources,
                          capture_output=True, text=True, timeout=120)


def test_workers_importing_other_sources_are_refused_and_one_image_everywhere_is_not(tmp_path):
    image = _copy_sources(tmp_path / "image")
    same_image_elsewhere = _copy_sources(tmp_path / "same-image")
    upgraded_image = _copy_sources(tmp_path / "upgraded", change="\n# the code location's newer release\n")

    # The driver (the Dagster code location) runs `image`: a KubeRay cluster on the same image passes.
    driver = subprocess.run(
        [sys.executable, "-c", "import json; from training_core.train.worker_code import CodeIdentity; "
                               "print(json.dumps(CodeIdentity.of_this_process().as_dict()))"],
        env={**os.environ, "PYTHONPATH": str(image), "TESSERA_CODE_VERSION": "abc123"}, cwd=image,
        capture_output=True, text=True, timeout=120, check=True)
    recorded = CodeIdentity(**json.loads(driver.stdout))
    assert recorded.code_version.startswith("abc123+src-")
    assert _worker_check(same_image_elsewhere, recorded).returncode == 0

    refused = _worker_check(upgraded_image, recorded)
    assert refused.returncode != 0 and "LineageError" in refused.stderr
    assert f"code: {recorded.code_version}, sources {recorded.source_digest} (recorded) ≠ abc123+src-" in refused.stderr
    assert f"Tessera sources in {upgraded_image}" in refused.stderr

    # A driver in a git checkout of the same code, a worker on sources without .git: the files decide.
    from_checkout = CodeIdentity("a" * 40, recorded.source_digest, recorded.package_versions,
                                 recorded.environment_digest)
    assert _worker_check(image, from_checkout).returncode == 0


def test_staging_or_committing_the_same_files_changes_no_worker_decision(tmp_path):
    """A developer commits a new module while a run started from the dirty tree trains: the next
    worker restart sees another code_version for the same files, and must not refuse them."""
    checkout = _copy_sources(tmp_path / "checkout")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    (checkout / "training_core" / "new_module.py").write_text("VALUE = 1\n")  # untracked
    identity = ("import json; from training_core.train.worker_code import CodeIdentity; "
                "print(json.dumps(CodeIdentity.of_this_process().as_dict()))")
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    started = CodeIdentity(**json.loads(subprocess.run([sys.executable, "-c", identity], env=env, cwd=checkout,
                                                       capture_output=True, text=True, timeout=120,
                                                       check=True).stdout))
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "the new module"], check=True)
    checked = _worker_check(checkout, started)
    assert "-dirty-" in started.code_version and checked.returncode == 0, checked.stderr
