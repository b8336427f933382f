"""Atomic publication of directories: readers see a complete directory or none at all."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

STAGING_PREFIX = ".staging-"
STALE_STAGING_S = 6 * 3600  # a staging folder this old, from any host, belongs to no live writer


@contextlib.contextmanager
def staging_directory(parent: Path) -> Iterator[Path]:
    """A fresh hidden directory under `parent`, removed on any error.

    Work is written here and then moved into place with `publish_directory`, so a crash never
    leaves a half-written dataset or model where a later run would pick it up. A process killed
    outright cannot remove its folder, so each new one first sweeps the leftovers of dead writers
    (named `.staging-<host>-<pid>-<id>`: same host and the process is gone, or older than 6 h).
    """
    parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_staging(parent)
    staging = parent / _writer_owned_name()
    staging.mkdir()
    try:
        yield staging
    finally:
        # After a successful publish the staging path no longer exists.
        shutil.rmtree(staging, ignore_errors=True)


def _writer_owned_name(purpose: str = "") -> str:
    """`.staging-<host>-<pid>-<purpose><id>`: the sweep reads it from the right (a host name may hold
    dashes; the pid and the last part never do), so every such folder of a dead writer is removed."""
    return f"{STAGING_PREFIX}{socket.gethostname()}-{os.getpid()}-{purpose}{uuid.uuid4().hex}"


def _remove_abandoned_staging(parent: Path) -> None:
    host, now = socket.gethostname(), time.time()
    for folder in parent.glob(f"{STAGING_PREFIX}*"):
        owner_host, _, rest = folder.name.removeprefix(STAGING_PREFIX).rpartition("-")[0].rpartition("-")
        pid = int(rest) if rest.isdigit() else None
        try:  # the newest change anywhere inside: a long write on another host is still alive
            age = now - max([folder.stat().st_mtime] + [p.stat().st_mtime for p in folder.rglob("*")])
        except FileNotFoundError:
            continue  # its writer just published or removed it
        dead_here = owner_host == host and pid is not None and not _process_alive(pid)
        if dead_here or age > STALE_STAGING_S:
            shutil.rmtree(folder, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def publish_directory(staging: Path, final: Path) -> Path:
    """Rename `staging` to `final` atomically. A content-addressed target that already exists
    wins when its files still match the digests recorded at its publication (the same digest
    means the same bytes); one damaged since (a file emptied or deleted by hand, an interrupted
    restore), or one that cannot be verified (its digest record is gone), is replaced by the fresh
    copy instead of being trusted, with a warning naming what differed."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if not final.exists():
        return _rename_into_place(staging, final)
    with _replacement_lock(final.parent):
        if final.exists():  # judged again: a writer before us may have just replaced it
            changed = changed_files(final)
            if changed == []:
                shutil.rmtree(staging, ignore_errors=True)
                return final
            log.warning("%s is not as published (%s): replacing it with the fresh copy", final,
                        ", ".join(changed) if changed else f"no {FILE_DIGESTS} to verify it against")
            _move_aside_and_remove(final)
        return _rename_into_place(staging, final)


PUBLISH_LOCK = ".publish.lock"
_LOCKS_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP}


@contextlib.contextmanager
def _replacement_lock(parent: Path) -> Iterator[None]:
    """Held from judging an existing copy until the fresh one is in place. Without it, two writers
    over one damaged copy race: one reads files the other has just moved aside (FileNotFoundError),
    or moves aside the fresh copy the other has just published and handed to its reader."""
    with open(parent / PUBLISH_LOCK, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed, or its process dies
        except OSError as error:
            if error.errno not in _LOCKS_UNSUPPORTED:
                raise
            log.debug("file locks refused in %s (%s): replacing without one", parent, error)
        yield


def _rename_into_place(staging: Path, final: Path) -> Path:
    flush_to_disk(staging)
    try:
        os.replace(staging, final)
    except OSError:
        if not final.exists():
            raise
        shutil.rmtree(staging, ignore_errors=True)  # another writer published the same content first
    sync_directory(final.parent)
    return final


def replace_directory(staging: Path, final: Path) -> Path:
    """Publish `staging` as `final`, replacing whatever is there (a folder named by its inputs,
    not its content: a new attempt's result wins). Readers see the old folder, no folder for
    the instant between two renames, or the new one; never a mix."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        _move_aside_and_remove(final)
    flush_to_disk(staging)
    os.replace(staging, final)
    sync_directory(final.parent)
    return final


def flush_to_disk(folder: Path) -> None:
    """fsync every file, then every directory bottom-up, so the rename that publishes `folder`
    cannot reach the disk before its contents do. Without it, a machine that loses power soon
    after a publish can come back with the published name holding empty or short files (ext4 and
    XFS order a new file's data after the metadata of a rename); a process that is merely killed
    loses nothing either way, since the page cache survives it."""
    directories = [folder]
    for path in folder.rglob("*"):
        if path.is_symlink():
            continue
        if path.is_dir():
            directories.append(path)
        elif path.is_file():
            flush_file(path)
    for directory in sorted(directories, key=lambda d: len(d.parts), reverse=True):
        sync_directory(directory)


# fsync refused as unsupported (some FUSE and CIFS mounts), or on a read-only mount: the data is
# as durable as that filesystem makes it, and the publish goes on. An I/O error still fails it.
_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EROFS}


def flush_file(path: Path) -> None:
    """fsync one file: call before renaming it over the name readers use."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno not in _FSYNC_UNSUPPORTED:
            raise
        log.debug("fsync of %s refused by its filesystem (%s): published without it", path, error)
    finally:
        os.close(descriptor)


def sync_directory(directory: Path) -> None:
    """Make a directory's entries (a rename into it, new files) durable. Some filesystems refuse
    fsync on a directory (EINVAL); they journal entries themselves or not at all."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _move_aside_and_remove(folder: Path) -> None:
    """Out of the way in one rename (to a staging name, swept if we die), then deleted."""
    aside = folder.with_name(_writer_owned_name("replaced."))
    with contextlib.suppress(FileNotFoundError):  # another writer may have moved it first
        os.replace(folder, aside)
    shutil.rmtree(aside, ignore_errors=True)


FILE_DIGESTS = ".file-digests.json"  # hidden: not part of the directory digest it explains


def directory_digest(directory: Path, *, exclude_hidden: bool = True, record_files: bool = False,
                     record_in: Path | None = None) -> str:
    """SHA-256 over relative paths and bytes of every file, in sorted order.

    ``record_files`` (when publishing) also writes each file's XXH3-128 to ``FILE_DIGESTS`` in the
    directory, so that a later mismatch can name the files that changed (:func:`changed_files`).
    ``record_in``: write that record to ``record_in/<digest>.json`` instead, for a directory that is
    not ours to write into (a user's model folder); :func:`outside_record` finds it again."""
    record_files = record_files or record_in is not None
    digest, files = hashlib.sha256(), {}
    for relative, path in _content_files(directory, exclude_hidden):
        digest.update(relative.encode())
        digest.update(b"\0")
        per_file = xxhash.xxh3_128() if record_files else None
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
                if per_file is not None:
                    per_file.update(chunk)
        digest.update(b"\0")
        if per_file is not None:
            files[relative] = per_file.hexdigest()
    if record_in is not None:
        record_in.mkdir(parents=True, exist_ok=True)
        pending = record_in / f".{uuid.uuid4().hex}.tmp"
        pending.write_text(json.dumps(files, indent=1, sort_keys=True))
        os.replace(pending, outside_record(record_in, digest.hexdigest()))
    elif record_files:
        (directory / FILE_DIGESTS).write_text(json.dumps(files, indent=1, sort_keys=True))
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    """XXH3-128 of one file's bytes, read in 1 MB pieces (as ``FILE_DIGESTS`` records each file)."""
    hasher = xxhash.xxh3_128()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            hasher.update(chunk)
    return hasher.hexdigest()


def outside_record(record_in: Path, digest: str) -> Path:
    """Where ``directory_digest(..., record_in=record_in)`` put the file record of a digest."""
    return record_in / f"{digest}.json"


def _content_files(directory: Path, exclude_hidden: bool) -> Iterator[tuple[str, Path]]:
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        relative = path.relative_to(directory).as_posix()
        if exclude_hidden and any(part.startswith(".") for part in relative.split("/")):
            continue
        yield relative, path


def changed_files(directory: Path, record: Path | None = None) -> list[str] | None:
    """What differs from the ``FILE_DIGESTS`` recorded at publication ("path (changed|added|
    removed)"), or None when the directory has no usable record: published before it was kept, or
    a record that is unreadable (emptied or truncated by a crash, edited by hand), which is named in
    a warning and then treated like a missing one, never trusted and never a traceback.
    ``record``: a record kept outside the directory (:func:`outside_record`)."""
    recorded_path = record or directory / FILE_DIGESTS
    if not recorded_path.is_file():
        return None
    try:
        recorded = json.loads(recorded_path.read_text())
    except (OSError, ValueError) as error:
        log.warning("file digest record %s is unreadable (%s): treating %s as unverified", recorded_path, error,
                    directory)
        return None
    if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        log.warning("file digest record %s is not a mapping of file names to digests: treating %s as unverified",
                    recorded_path, directory)
        return None
    current = {relative: file_digest(path) for relative, path in _content_files(directory, exclude_hidden=True)}
    return sorted([f"{name} (changed)" for name in current.keys() & recorded.keys() if current[name] != recorded[name]]
                  + [f"{name} (added)" for name in current.keys() - recorded.keys()]
                  + [f"{name} (removed)" for name in recorded.keys() - current.keys()])
