"""The lineage record: everything needed to rerun a training run from its MLflow run id."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from training_core.errors import ConfigError

# Packages whose version can change a training result; numpy draws the data order (its Generator
# streams are not promised stable across versions), tokenizers tokenizes the eval records, safetensors
# writes and reads the weights, accelerate places them (PEFT and transformers import it). Their
# versions, bitsandbytes' (QLoRA numerics; "not installed" where it is not) and the interpreter's
# are in every lineage record, and their digest is part of what decides whether a run is reused or
# resumed (runs.REUSE_KEYS).
TRACKED_PACKAGES = ("torch", "deepspeed", "transformers", "peft", "ray", "pyarrow", "numpy", "tokenizers",
                    "safetensors", "accelerate")
OPTIONAL_TRACKED_PACKAGES = ("bitsandbytes",)
# Recorded only, outside the digest: they schedule and log a run, its numbers do not depend on them,
# so upgrading them must not retrain (or refuse to resume) every run.
RECORDED_PACKAGES = ("dagster", "mlflow")
PYTHON = "python"  # `version_python`: the interpreter (compiled libraries are built per Python version)
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
    return f"{label}+src-{source_digest(repo_root)}"


def source_digest(repo_root: Path = REPO_ROOT) -> str:
    """A hash of the code as files: every Python file of Tessera's packages and pyproject.toml, by
    content, however git sees them (committed, staged, untracked or no checkout at all)."""
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
    """The versions a training result depends on (`environment_digest` hashes them)."""
    versions = {f"version_{name}": importlib.metadata.version(name) for name in TRACKED_PACKAGES}
    versions |= {f"version_{name}": installed_version(name) for name in OPTIONAL_TRACKED_PACKAGES}
    return {**versions, f"version_{PYTHON}": platform.python_version()}


def recorded_only_versions() -> dict[str, str]:
    """Versions in the lineage record that decide nothing (see RECORDED_PACKAGES)."""
    return {f"version_{name}": installed_version(name) for name in RECORDED_PACKAGES}


def environment_digest(versions: dict[str, str]) -> str:
    """One value for the tracked package versions (`package_versions()`): an upgrade within the
    ranges pyproject.toml allows changes it, so the same inputs train afresh instead of reusing, or
    resuming the checkpoints of, a run made with other libraries."""
    return hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:16]


def installed_version(package: str) -> str:
    """The installed version, or "not installed" (a recorded run may name a package this
    environment no longer has); for "python", this interpreter's (`version_python`)."""
    if package == PYTHON:
        return platform.python_version()
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def parse_partition_keys(value: str) -> list[str]:
    """The `partition_keys` param as written by :func:`build_lineage_record`: the days of the training
    window, oldest first, comma-separated ("" when the run recorded none)."""
    return [key for key in value.split(",") if key]


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
        **recorded_only_versions(),
    }


def hardware_tags() -> dict[str, str]:
    """This machine, as MLflow tags: float results can differ across CPUs, GPUs and CUDA / cuDNN /
    NCCL builds, but a machine is not an input, so no digest holds them and they decide no reuse.
    The GPU ones only where torch sees a GPU."""
    import torch

    tags = {"hardware.platform": platform.platform(), "hardware.cpu": _cpu_model(),
            "hardware.cpu_count": str(os.cpu_count())}
    if torch.cuda.is_available():
        cudnn = torch.backends.cudnn.version()
        has_nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()  # a build option
        tags |= {
            "hardware.gpu": torch.cuda.get_device_name(),
            "hardware.gpu_count": str(torch.cuda.device_count()),
            "hardware.cuda": torch.version.cuda or f"none (ROCm {torch.version.hip})",
            "hardware.cudnn": str(cudnn) if cudnn is not None else "not available",
            "hardware.nccl": ".".join(str(part) for part in torch.cuda.nccl.version()) if has_nccl else "not available",
        }
    return tags


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():  # Linux: platform.processor() says only "x86_64"
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model") and value.strip():  # x86 / ARM
                return value.strip()
    return platform.processor() or platform.machine() or "unknown"


# A patch larger than this is not saved (a 16 MiB code change is generated files, not edits).
LARGEST_CODE_PATCH = 16 * 2**20
# What `git apply` needs, whatever the user's git config: binary hunks, no colour, no external diff tool,
# a/ and b/ prefixes (diff.noprefix drops them).
_PATCH_OPTIONS = ("--binary", "--no-color", "--no-ext-diff", "--src-prefix=a/", "--dst-prefix=b/")


@dataclass(frozen=True)
class CodeChanges:
    """The uncommitted code changes `code_version`'s `-dirty-<hash>` stands for."""

    files: list[str]  # changed and untracked code files, relative to the repository root
    patch: bytes | None  # restores them on the commit (`git apply`); None when over LARGEST_CODE_PATCH


def uncommitted_code_changes(repo_root: Path = REPO_ROOT) -> CodeChanges | None:
    """The changes to the files `code_version` covers: the diff of tracked ones and each untracked one
    as a new file, in one patch. None for a clean tree, or outside a git checkout (its code version
    hashes the sources; there is no commit to patch)."""
    try:
        tracked = _git(repo_root, "diff", *_PATCH_OPTIONS, "HEAD", "--", *_CODE_PATHSPECS)
        changed = _git(repo_root, "diff", "-z", "--name-only", "HEAD", "--", *_CODE_PATHSPECS)
        untracked = _git(repo_root, "ls-files", "-z", "--others", "--exclude-standard", "--", *_CODE_PATHSPECS)
        untracked_names = sorted(os.fsdecode(name) for name in untracked.split(b"\0") if name)
        files = sorted({os.fsdecode(name) for name in changed.split(b"\0") if name} | set(untracked_names))
        if not files:
            return None
        patch = bytearray(tracked)
        for name in untracked_names:
            # sized before it is read: an untracked file may be gigabytes of data
            if len(patch) + (repo_root / name).lstat().st_size > LARGEST_CODE_PATCH:
                return CodeChanges(files=files, patch=None)
            # --no-index exits 1 when the files differ, which they always do here
            patch += _git(repo_root, "diff", "--no-index", *_PATCH_OPTIONS, "--", "/dev/null", name, ok_codes=(0, 1))
    except (OSError, subprocess.SubprocessError):
        return None
    return CodeChanges(files=files, patch=bytes(patch) if len(patch) <= LARGEST_CODE_PATCH else None)


def _git(repo_root: Path, *arguments: str, ok_codes: tuple[int, ...] = (0,)) -> bytes:
    done = subprocess.run(["git", "-C", str(repo_root), *arguments], capture_output=True, timeout=60)
    if done.returncode not in ok_codes:
        raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
    return done.stdout
