"""What the lineage record and an MLflow run's lineage hold beyond the contract's digests: every
library a result depends on (in the reuse digest), the ones it does not (recorded only), the
machine (tags), and the uncommitted code a `-dirty-` code version stands for (an artifact that
restores it). Real git in a temporary repository and a real SQLite MLflow store."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
from pathlib import Path

import pytest

from training_core import lineage as lineage_module
from training_core.tracking import MlflowTracking

RESULT_LIBRARIES = ("tokenizers", "safetensors", "accelerate")


def _record() -> dict[str, str]:
    return lineage_module.build_lineage_record(
        seed=0, data_seed=0, dataset_digest="d" * 64, dataset_paths=["/data/day"], cache_version="c",
        base_model="/models/base", base_model_digest="b" * 64, config_digest="f" * 64, dagster_run_id="r",
        partition_keys=["2026-11-01"])


def test_every_library_a_result_depends_on_and_python_decide_reuse_dagster_and_mlflow_are_recorded_only():
    record = _record()
    for package in RESULT_LIBRARIES:
        assert record[f"version_{package}"] == importlib.metadata.version(package)
    assert record["version_bitsandbytes"] == lineage_module.installed_version("bitsandbytes")  # or "not installed"
    assert record["version_python"] == platform.python_version()
    assert record["version_dagster"] == importlib.metadata.version("dagster")
    assert record["version_mlflow"] == importlib.metadata.version("mlflow")

    deciding = {key: value for key, value in record.items()
                if key.startswith("version_") and key not in ("version_dagster", "version_mlflow")}
    assert record["environment_digest"] == lineage_module.environment_digest(deciding)
    assert lineage_module.package_versions() == deciding  # what a worker recomputes to compare with the driver's
    # A newer tokenizers (eval records tokenize differently) or interpreter: not the same environment.
    for changed in ({"version_tokenizers": "0.0.1"}, {"version_python": "3.0.0"}):
        assert lineage_module.environment_digest({**deciding, **changed}) != record["environment_digest"]


def test_reproduce_names_a_changed_python_and_stays_silent_on_versions_an_older_run_never_recorded():
    from training_core.reproduce import lineage_drift

    record = _record()
    assert lineage_drift({key: value for key, value in record.items() if key.startswith("version_")}) == []
    assert lineage_drift({"version_python": "3.0.0"}) == [("version_python", "3.0.0", platform.python_version())]
    # A run recorded before tokenizers was tracked: unknown, not "changed".
    older = {f"version_{package}": record[f"version_{package}"]
             for package in ("torch", "deepspeed", "transformers", "peft", "ray", "pyarrow", "numpy")}
    assert "version_tokenizers" not in older and lineage_drift(older) == []


def _tracking(tmp_path: Path) -> MlflowTracking:
    return MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")


def test_the_run_is_tagged_with_the_machine_outside_its_params(tmp_path: Path):
    import torch

    tracking = _tracking(tmp_path)
    run_id = tracking.start_run("hardware", tags={})
    tracking.log_lineage(run_id, lineage=_record(), config={}, dataset_paths=[], repo_root=tmp_path)

    run = tracking.client.get_run(run_id)
    assert run.data.tags["hardware.platform"] == platform.platform()
    assert run.data.tags["hardware.cpu_count"].isdigit()
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
              if line.startswith("model name")] if cpuinfo.is_file() else []
    if models:  # x86 Linux: the CPU's name, not platform.processor()'s "x86_64"
        assert run.data.tags["hardware.cpu"] == models[0]
    gpu_tags = {"hardware.gpu", "hardware.gpu_count", "hardware.cuda", "hardware.cudnn", "hardware.nccl"}
    if torch.cuda.is_available():
        assert gpu_tags <= set(run.data.tags) and run.data.tags["hardware.gpu"] == torch.cuda.get_device_name()
    else:
        assert not gpu_tags & set(run.data.tags)
    assert not any(key.startswith("hardware") for key in run.data.params)  # no digest, no reuse decision


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def _committed_repo(path: Path) -> str:
    path.mkdir()
    _git(path, "init", "-q")
    (path / "training_core").mkdir()
    (path / "training_core" / "train.py").write_text("LEARNING_RATE = 1e-4\n")
    (path / "pyproject.toml").write_text("[project]\nname = 't'\n")
    (path / "README.md").write_text("docs\n")
    (path / ".gitignore").write_text("state/\n")
    _git(path, "add", ".")
    _git(path, "-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-qm", "init")
    return _git(path, "rev-parse", "HEAD").strip()


def _logged_artifacts(tracking: MlflowTracking, repo: Path, destination: Path) -> Path:
    run_id = tracking.start_run("code", tags={})
    lineage = {"code_version": lineage_module.code_version(repo)}
    tracking.log_lineage(run_id, lineage=lineage, config={}, dataset_paths=[], repo_root=repo)
    return Path(tracking.client.download_artifacts(run_id, "", str(destination)))


@pytest.mark.parametrize("noprefix", [False, True], ids=["git defaults", "diff.noprefix set"])
def test_uncommitted_code_is_logged_as_a_patch_that_restores_it_on_its_commit(tmp_path: Path, monkeypatch, noprefix):
    if noprefix:  # a common personal setting: without a/ b/ prefixes the patch would apply to nothing
        monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
        monkeypatch.setenv("GIT_CONFIG_KEY_0", "diff.noprefix")
        monkeypatch.setenv("GIT_CONFIG_VALUE_0", "true")
    repo = tmp_path / "repo"
    sha = _committed_repo(repo)
    tracking = _tracking(tmp_path)
    clean = _logged_artifacts(tracking, repo, tmp_path / "clean")
    assert sorted(p.name for p in clean.iterdir()) == ["lineage.json", "training_config.json"]

    (repo / "training_core" / "train.py").write_text("LEARNING_RATE = 3e-4\n")  # edited
    (repo / "training_core" / "scale.py").write_text("SCALE = 10.0\n")  # never `git add`ed: code too
    (repo / "README.md").write_text("edited docs\n")  # not code: no code version change, not in the patch
    (repo / "state").mkdir()
    (repo / "state" / "run.py").write_text("ignored = True\n")
    dirty = _logged_artifacts(tracking, repo, tmp_path / "dirty")
    patch = (dirty / "code_changes.patch").read_bytes()
    assert b"README" not in patch and b"state/" not in patch

    restored = tmp_path / "restored"
    subprocess.run(["git", "clone", "-q", str(repo), str(restored)], check=True)
    _git(restored, "checkout", "-q", sha)
    subprocess.run(["git", "-C", str(restored), "apply", str(dirty / "code_changes.patch")], check=True)
    assert lineage_module.code_version(restored) == lineage_module.code_version(repo)  # the very same code
    assert (restored / "training_core" / "scale.py").read_text() == "SCALE = 10.0\n"


def test_code_changes_too_large_for_a_patch_are_named_not_half_saved(tmp_path: Path, caplog):
    repo = tmp_path / "repo"
    _committed_repo(repo)
    (repo / "training_core" / "train.py").write_text("LEARNING_RATE = 3e-4\n")
    with (repo / "training_core" / "generated.py").open("wb") as file:  # sized, never read
        file.truncate(lineage_module.LARGEST_CODE_PATCH + 1)

    with caplog.at_level("WARNING"):
        logged = _logged_artifacts(_tracking(tmp_path), repo, tmp_path / "logged")
    assert not (logged / "code_changes.patch").exists()
    note = (logged / "code_changes_not_saved.txt").read_text()
    assert "16 MiB" in note and "training_core/generated.py" in note and "training_core/train.py" in note
    assert "not saved" in caplog.text


def test_no_code_patch_outside_a_git_checkout(tmp_path: Path):
    sources = tmp_path / "image"  # a container image: the sources without .git
    (sources / "training_core").mkdir(parents=True)
    (sources / "training_core" / "train.py").write_text("LEARNING_RATE = 1e-4\n")
    assert lineage_module.uncommitted_code_changes(sources) is None
    logged = _logged_artifacts(_tracking(tmp_path), sources, tmp_path / "logged")
    assert sorted(p.name for p in logged.iterdir()) == ["lineage.json", "training_config.json"]


def test_no_code_patch_without_git(tmp_path: Path, monkeypatch):
    repo = tmp_path / "repo"
    _committed_repo(repo)
    (repo / "training_core" / "train.py").write_text("LEARNING_RATE = 3e-4\n")
    monkeypatch.setenv("PATH", str(tmp_path / "no-binaries"))  # git not installed
    assert lineage_module.uncommitted_code_changes(repo) is None
