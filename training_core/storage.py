"""Atomic publication of directories: readers see a complete directory or none at all."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def staging_directory(parent: Path) -> Iterator[Path]:
    """A fresh hidden directory under `parent`, removed on any error.

    Work is written here and then moved into place with `publish_directory`, so a crash never
    leaves a half-written dataset or model where a later run would pick it up.
    """
    parent.mkdir(parents=True, exist_ok=True)
    staging = parent / f".staging-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        yield staging
    finally:
        # After a successful publish the staging path no longer exists.
        shutil.rmtree(staging, ignore_errors=True)


def publish_directory(staging: Path, final: Path) -> Path:
    """Rename `staging` to `final` atomically. Content-addressed targets that already exist win:
    the same digest means the same bytes, so the new copy is discarded."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        shutil.rmtree(staging, ignore_errors=True)
        return final
    try:
        os.replace(staging, final)
    except OSError:
        if not final.exists():
            raise
        shutil.rmtree(staging, ignore_errors=True)
    return final


def directory_digest(directory: Path, *, exclude_hidden: bool = True) -> str:
    """SHA-256 over relative paths and bytes of every file, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        relative = path.relative_to(directory).as_posix()
        if exclude_hidden and any(part.startswith(".") for part in relative.split("/")):
            continue
        digest.update(relative.encode())
        digest.update(b"\0")
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()
