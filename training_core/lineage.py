"""The lineage record: everything needed to rerun a training run from its MLflow run id."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
from pathlib import Path

from training_core.errors import ConfigError

# Packages whose version can change a training result; numpy draws the data order (its Generator
# streams are not promised stable across versions). Their versions are in every lineage record,
# and their digest is part of what decides whether a run is reused or resumed (runs.REUSE_KEYS).
TRACKED_PACKAGES = ("torch", "deepspeed", "transformers", "peft", "ray", "pyarrow", "numpy")
REPO_ROOT = Path(__file__).resolve().parent.parent


def code_version(repo_root: Path = REPO_ROOT) -> str:
    """`git sha`, plus `-dirty-<hash>` with uncommitted changes to the code (the files
    :func:`installed_code_version` hashes: a README or benchmark-result edit changes no run): the diff
    and the files git does not track yet (a new module never `git add`ed is code too), so two
    different dirty trees never look alike. Outside a git checkout (a container image holds the
    sources without `.git`), see :func:`installed_code_version`."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(repo_root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        diff = subprocess.run(
            ["git", "-C", str(repo_root), "diff", "HEAD", "--", *_CODE_PATHSPECS],
            capture_output=True, check=True, timeout=30,
        ).stdout
        untracked = subprocess.run(  # ignored files (.venv, .tessera/, caches) are not code: left out
            ["git", "-C", str(repo_root), "ls-files", "-z", "--others", "--exclude-standard", "--", *_CODE_PATHSPECS],
            capture_output=True, check=True, timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return installed_code_version(repo_root)
    if not diff.strip() and not untracked:
        return sha
    dirty = hashlib.sha256(diff)  # with no untracked files, the hash a diff alone always had
    for name in sorted(name for name in untracked.split(b"\0") if name):  # sorted: git's order is not promised
        dirty.update(b"\0untracked\0" + name + b"\0" + _file_digest(repo_root / os.fsdecode(name)))
    return f"{sha}-dirty-{dirty.hexdigest()[:12]}"


# Tessera's own top-level packages (pyproject.toml's packages.find) and the file that pins its
# dependencies: the code a run executes, wherever it is installed.
CODE_PACKAGES = ("pipelines", "assets", "ops", "resources", "training_core", "bench", "deploy")
# The same files as git pathspecs, relative to the repository root (`git -C` runs them there).
_CODE_PATHSPECS = ("pyproject.toml", *(f":(glob){package}/**/*.py" for package in CODE_PACKAGES))
CODE_VERSION_ENV = "TESSERA_CODE_VERSION"
_CODE_VERSION_LABEL = re.compile(r"[\w.+=:/@-]{1,100}")


def installed_code_version(repo_root: Path = REPO_ROOT) -> str:
    """The code version of sources that are not a git checkout: `<label>+src-<hash>`. The label is
    `$TESSERA_CODE_VERSION` when the image build recorded one (the git sha it was built from), else
    `tessera==<version>`; the hash covers every Python file of Tessera's packages and pyproject.toml,
    so two images built from different code never share a version (and so never reuse each other's
    runs) even when nobody bumped the package version or passed the build argument."""
    label = os.environ.get(CODE_VERSION_ENV, "").strip()
    if label and not _CODE_VERSION_LABEL.fullmatch(label):  # it goes into MLflow search filters
        raise ConfigError(f"{CODE_VERSION_ENV}={label!r}: a code version label is a git sha or tag (letters, "
                          "digits and . _ - + = : / @, at most 100 characters)")
    label = label or f"tessera=={installed_version('tessera')}"
    return f"{label}+src-{_source_digest(repo_root)}"


def _source_digest(repo_root: Path) -> str:
    digest = hashlib.sha256()
    files = [repo_root / "pyproject.toml"] if (repo_root / "pyproject.toml").is_file() else []
    for package in CODE_PACKAGES:
        files.extend((repo_root / package).rglob("*.py"))
    for path in sorted(files):
        digest.update(path.relative_to(repo_root).as_posix().encode() + b"\0" + _file_digest(path))
    return digest.hexdigest()[:12]


_LARGEST_HASHED_FILE = 8 * 2**20  # larger untracked files (data someone left in the checkout): size + mtime


def _file_digest(path: Path) -> bytes:
    """SHA-256 of a file's bytes (of its target's name for a symlink, as git records it; of its size
    and mtime when larger than any source file, so a launch never reads gigabytes); a file removed
    or unreadable since it was listed gets a fixed marker rather than failing the launch."""
    try:
        if path.is_symlink():
            return hashlib.sha256(os.fsencode(os.readlink(path))).digest()
        if (stat := path.stat()).st_size > _LARGEST_HASHED_FILE:
            return hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode()).digest()
        with path.open("rb") as file:
            return hashlib.file_digest(file, "sha256").digest()
    except OSError:
        return b"unreadable"


def package_versions() -> dict[str, str]:
    return {f"version_{name}": importlib.metadata.version(name) for name in TRACKED_PACKAGES}


def environment_digest(versions: dict[str, str]) -> str:
    """One value for the tracked package versions (`package_versions()`): an upgrade within the
    ranges pyproject.toml allows changes it, so the same inputs train afresh instead of reusing, or
    resuming the checkpoints of, a run made with other libraries."""
    return hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:16]


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
    versions = package_versions()
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
        **versions,
        "environment_digest": environment_digest(versions),
    }
