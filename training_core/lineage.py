"""The lineage record: everything needed to rerun a training run from its MLflow run id."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import subprocess
from pathlib import Path

TRACKED_PACKAGES = ("torch", "deepspeed", "transformers", "peft", "ray", "pyarrow")
REPO_ROOT = Path(__file__).resolve().parent.parent


def code_version(repo_root: Path = REPO_ROOT) -> str:
    """`git sha`, plus `-dirty-<hash of the diff>` with uncommitted changes (so two different dirty
    trees never look alike), or the installed package version outside a git checkout."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(repo_root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        diff = subprocess.run(
            ["git", "-C", str(repo_root), "diff", "HEAD"], capture_output=True, check=True, timeout=30
        ).stdout
        return f"{sha}-dirty-{hashlib.sha256(diff).hexdigest()[:12]}" if diff.strip() else sha
    except (OSError, subprocess.SubprocessError):
        return f"tessera=={importlib.metadata.version('tessera')}"


def package_versions() -> dict[str, str]:
    return {f"version_{name}": importlib.metadata.version(name) for name in TRACKED_PACKAGES}


def installed_version(package: str) -> str:
    """The installed version, or "not installed" (a recorded run may name a package this
    environment no longer has)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def parse_dataset_paths(value: str) -> list[str]:
    """The `dataset_paths` param as written by :func:`build_lineage_record`: a JSON list, or a
    comma-separated string for runs recorded before paths could hold a comma (published datasets
    are absolute paths or URIs, so never start with "["). Raises ValueError when the JSON is not a
    list of strings."""
    if not value.startswith("["):
        return [path for path in value.split(",") if path]
    paths = json.loads(value)
    if not isinstance(paths, list) or not all(isinstance(path, str) for path in paths):
        raise ValueError(f"expected a JSON list of path strings, got {value!r}")
    return paths


def build_lineage_record(
    *,
    seed: int,
    data_seed: int,
    dataset_digest: str,
    dataset_paths: list[str],
    cache_version: str,
    base_model: str,
    base_model_digest: str,
    config_digest: str,
    dagster_run_id: str,
    partition_keys: list[str],
) -> dict[str, str]:
    """The contract record (DESIGN.md), as strings: logged as MLflow params of every training run."""
    return {
        "seed": str(seed),
        "data_seed": str(data_seed),
        "dataset_digest": dataset_digest,
        # JSON, not ",".join: a path may contain a comma (`parse_dataset_paths` reads both forms)
        "dataset_paths": json.dumps(list(dataset_paths)),
        "cache_version": cache_version,
        "base_model": base_model,
        "base_model_digest": base_model_digest,
        "config_digest": config_digest,
        "code_version": code_version(),
        "dagster_run_id": dagster_run_id,
        "partition_keys": ",".join(partition_keys),
        **package_versions(),
    }
