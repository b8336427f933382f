"""Where a worker writes a checkpoint before Ray Train copies it to the run's storage.

On the worker's local disk (`tempfile.gettempdir()`, i.e. $TMPDIR), not on the shared storage:
staging there would send every checkpoint over the network twice. A worker killed while saving or
reporting cannot remove its folder, and a periodic checkpoint holds DeepSpeed's optimizer state
(gigabytes per rank for a full fine-tune), so folders are named by their process
(`tessera-ckpt-<host>-<pid>-<start time>-<random>`) and each worker, when it starts, removes
those of processes on its host that are gone."""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from training_core.process_identity import process_is_gone, this_process

log = logging.getLogger(__name__)

STAGING_PREFIX = "tessera-ckpt-"


@functools.cache
def _own_prefix() -> str:
    # this_process() is `<host>:<pid>:<start time>`; a host name holds no colon, a folder name should not.
    return f"{STAGING_PREFIX}{this_process().replace(':', '-')}-"


@contextlib.contextmanager
def checkpoint_staging_directory() -> Iterator[Path]:
    """A fresh folder for one checkpoint, removed when the block ends (Ray has copied it by then)."""
    with tempfile.TemporaryDirectory(prefix=_own_prefix()) as directory:
        yield Path(directory)


def remove_abandoned_checkpoint_staging(parent: Path | None = None) -> list[Path]:
    """Remove the staging folders under `parent` (default: the temporary folder) of processes on
    this host that are gone; returns them. Folders of live processes, of other hosts (a shared
    temporary folder) and names this module did not write are left alone."""
    parent = Path(tempfile.gettempdir()) if parent is None else parent
    removed = []
    for folder in parent.glob(f"{STAGING_PREFIX}*"):
        # Read from the right: a host name may hold dashes; pid, start time and the random suffix never do.
        owner = folder.name.removeprefix(STAGING_PREFIX).rsplit("-", 3)
        if len(owner) != 4 or not process_is_gone(":".join(owner[:3])):
            continue
        try:
            shutil.rmtree(folder)
        except FileNotFoundError:
            continue  # another worker on this host removed it first
        except OSError as error:
            log.warning("could not remove checkpoint staging folder %s of a process that is gone: %s", folder, error)
            continue
        log.info("removed the checkpoint staging folder %s of a process that is gone", folder)
        removed.append(folder)
    return removed
