"""Where a Tessera deployment keeps its state: one root folder ($TESSERA_HOME)."""


import contextlib
import os
import uuid
from pathlib import Path

import dagster as dg
from pydantic import Field, field_validator

from training_core.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
RAY_STORAGE_ENV = "TESSERA_RAY_STORAGE"  # storage.ray_storage_uri on Kubernetes (ConfigMap tessera-config)


# SQLite URLs, MLflow's store and Dagster's storage alike, read "?" as the start of a query and "%XX"
# as an escaped character: a state folder whose path holds either put those databases at another
# path, outside the folder (or failed to open them, naming no path).
_URL_SPECIAL = ("?", "%")


def state_root(home: str | None) -> Path:
    """The state root: ``home`` (storage.home, ``--home``), else $TESSERA_HOME, else .tessera/ in the
    repo, as an absolute path; creates nothing."""
    root = Path(home or os.environ.get("TESSERA_HOME") or REPO_ROOT / ".tessera").expanduser().resolve()
    if special := [character for character in _URL_SPECIAL if character in str(root)]:
        raise ConfigError(
            f"state folder {root} (storage.home / TESSERA_HOME / --home): its path holds {' and '.join(map(repr, special))}, "
            "which the SQLite URLs of MLflow's store and Dagster's storage would misread (a database written "
            "outside the folder); choose a path without them")
    return root


def refuse_read_only_state(root: Path, *paths: Path, chosen_by: str = "--home / TESSERA_HOME") -> None:
    """Raise naming the first existing one of ``paths`` (in the state folder ``root``, set by
    ``chosen_by``) this process cannot write. A populated read-only folder otherwise failed inside
    Dagster's or MLflow's SQLite ("unable to open database file", blaming dagster.yaml) or, in
    `tessera reproduce`, only after Ray had started ("attempt to write a readonly database" deep in a
    traceback)."""
    for path in paths:
        if path.exists() and not os.access(path, os.W_OK):  # also False on a read-only mount, even for root
            read_only_disk = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
            why = "on a read-only file system" if read_only_disk else "not writable by this user"
            raise ConfigError(f"state folder {root} is read-only ({path} is {why}); make it writable, or use a "
                              f"writable state folder ({chosen_by})")


# What a run writes in the state folder, besides ray/ unless ray_storage_uri is elsewhere (dagster/ is the
# instance's, checked before a run starts). Not the root: a read-only volume root with writable subfolders works.
_RUN_WRITES = ("datasets", "cache", "models", "mlartifacts", "mlflow.db")


class TesseraStorage(dg.ConfigurableResource):
    """State directory layout (contract): dagster/, mlflow.db, mlartifacts/, datasets/, cache/,
    ray/, models/. Deleting the root resets everything."""

    home: str | None = Field(None, description="state root; default $TESSERA_HOME or .tessera/ in the repo")
    ray_storage_uri: str | None = Field(
        None, description="Ray Train storage (checkpoints): an absolute path that every Ray node and the "
                          "training step see at the same place (a shared volume); default <home>/ray. "
                          "Not an object-store URI",
    )

    @field_validator("ray_storage_uri", mode="before")
    @classmethod
    def _absolute_local_path(cls, value: object) -> object:
        """The launcher resumes and relaunches by reading a run's checkpoints as local files, and
        Ray Train gets the folder as a path: ``s3://bucket/x`` became ``s3:/bucket/x`` and failed
        only after Ray had started, a relative path likewise, neither naming this setting. An
        ``EnvVar`` is checked once Dagster resolves it (before, the value is the variable's name)."""
        if value is None or isinstance(value, dg.EnvVar):
            return value
        text = str(value)
        if "://" in text or not Path(text).expanduser().is_absolute():
            raise ValueError(
                f"storage.ray_storage_uri ({RAY_STORAGE_ENV} on Kubernetes) {text!r}: expected an absolute path; "
                "object-store URIs are not supported. To share checkpoints across nodes, mount one filesystem "
                "(NFS, EFS, CephFS, ...) at the same path on every node and name a folder on it")
        return str(Path(text).expanduser())

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        """A read-only state folder given as storage.home in run config is refused as the run starts:
        steps otherwise failed one by one on a bare "Read-only file system" in a staging folder."""
        root = self.root
        writes = _RUN_WRITES if self.ray_storage_uri else (*_RUN_WRITES, "ray")
        refuse_read_only_state(root, *(root / name for name in writes), chosen_by="storage.home / TESSERA_HOME")

    @property
    def root(self) -> Path:
        return state_root(self.home)

    def folder(self, name: str) -> Path:
        path = self.root / name
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # a file in the way, no permission, a read-only disk
            raise ConfigError(f"state folder {self.root} (storage.home / TESSERA_HOME) is not usable: "
                              f"cannot create {path}: {error.strerror or error}") from error
        check_not_moved(self.root)
        return path

    @property
    def base_model_digests(self) -> Path:
        """Per-file digests of users' base-model folders (kept here, not in their folders)."""
        return self.folder("models") / "base-digests"

    @property
    def ray_storage(self) -> str:
        return self.ray_storage_uri or str(self.folder("ray"))


HOME_MARKER = ".tessera-home"  # the absolute path the state folder was created at
_CHECKED_ROOTS: set[Path] = set()  # verified in this process: `folder` runs on every path lookup


def check_not_moved(root: Path) -> None:
    """Refuse a state folder that was moved or copied from where it was created.

    MLflow's experiment, the lineage of every run and Dagster's stored step values hold absolute
    paths into it: after a move, new runs would write artifacts under the old path again (outside
    the state folder), and the champion's model could no longer be loaded, so the champion gate
    would compare with nothing. A symlink from the old path to the new one is fine."""
    if root in _CHECKED_ROOTS:
        return
    marker = root / HOME_MARKER
    try:
        recorded = marker.read_text().strip()
    except FileNotFoundError:
        pending = root / f"{HOME_MARKER}.{uuid.uuid4().hex}.tmp"
        try:
            pending.write_text(str(root) + "\n")
            os.replace(pending, marker)
            _CHECKED_ROOTS.add(root)
        except OSError:  # a read-only root (its subfolders writable): nothing can be recorded, nor checked
            with contextlib.suppress(OSError):
                pending.unlink(missing_ok=True)
        return
    except OSError:
        return  # unreadable: `folder` has already said whether the state folder is usable
    if recorded and Path(recorded).resolve() != root.resolve():
        raise ConfigError(
            f"state folder {root} (storage.home / TESSERA_HOME) was created at {recorded} and has been moved "
            "or copied since; its MLflow runs, lineage and Dagster step values name files under the old "
            f"path. Move it back, make {recorded} a symlink to {root}, or start from an empty state folder"
        )
    _CHECKED_ROOTS.add(root)
