"""Where a Tessera deployment keeps its state: one root folder ($TESSERA_HOME)."""


import os
from pathlib import Path

import dagster as dg
from pydantic import Field

from training_core.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent


def default_home() -> Path:
    return Path(os.environ.get("TESSERA_HOME") or REPO_ROOT / ".tessera").expanduser().resolve()


class TesseraStorage(dg.ConfigurableResource):
    """State directory layout (contract): dagster/, mlflow.db, mlartifacts/, datasets/, cache/,
    ray/, models/. Deleting the root resets everything."""

    home: str | None = Field(None, description="state root; default $TESSERA_HOME or .tessera/ in the repo")
    ray_storage_uri: str | None = Field(
        None, description="Ray Train storage (checkpoints), shared by all nodes; default <home>/ray"
    )

    @property
    def root(self) -> Path:
        return Path(self.home).expanduser().resolve() if self.home else default_home()

    def folder(self, name: str) -> Path:
        path = self.root / name
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # a file in the way, no permission, a read-only disk
            raise ConfigError(f"state folder {self.root} (storage.home / TESSERA_HOME) is not usable: "
                              f"cannot create {path}: {error.strerror or error}") from error
        return path

    @property
    def base_model_digests(self) -> Path:
        """Per-file digests of users' base-model folders (kept here, not in their folders)."""
        return self.folder("models") / "base-digests"

    @property
    def ray_storage(self) -> str:
        return self.ray_storage_uri or str(self.folder("ray"))
