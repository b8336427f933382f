"""Where Dagster keeps asset values between steps: its pickle store, written atomically.

Dagster's filesystem IO manager opens an asset's file with "wb" and pickles into it, so a process
killed mid-write leaves the last *recorded* materialization's file empty or holding another value:
a later run of downstream assets alone then fails to unpickle it, or loads a value its lineage
does not name. Here each value goes to a temporary file next to it, renamed over the old one.
"""

import os
import uuid

import dagster as dg
from dagster._core.storage.fs_io_manager import PickledObjectFilesystemIOManager


class AtomicPickleIOManager(PickledObjectFilesystemIOManager):
    def dump_to_path(self, context: dg.OutputContext, obj, path) -> None:
        if getattr(path, "protocol", "") not in ("", "file", "local"):
            super().dump_to_path(context, obj, path)  # object stores write whole objects anyway
            return
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            super().dump_to_path(context, obj, temporary)
            os.replace(temporary, path)
        finally:
            if temporary.exists():
                temporary.unlink()


class AtomicFilesystemIOManager(dg.FilesystemIOManager):
    """`FilesystemIOManager` (same `base_dir` rule: the instance's storage folder by default) with
    atomic writes."""

    @classmethod
    def _is_dagster_maintained(cls) -> bool:
        return False

    def create_io_manager(self, context: dg.InitResourceContext) -> AtomicPickleIOManager:
        return AtomicPickleIOManager(base_dir=self.base_dir or context.instance.storage_directory())
