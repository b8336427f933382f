"""Listing a local folder of data files as both the source reader and the row-group reader do:
links followed, each real folder walked once, hidden and underscore names left out."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

log = logging.getLogger(__name__)


def is_hidden_or_underscore(relative: str) -> bool:
    """Hidden and underscore names anywhere below a data root are not data: a writer's staging folder
    (.staging-*, Spark's _temporary/) may hold partial files; _SUCCESS and .crc are markers."""
    return any(part.startswith((".", "_")) for part in PurePosixPath(relative).parts)


def walk_local_files(root: str | Path, refuse: Callable[[OSError], Exception],
                     on_skipped_folder: Callable[[str], None] | None = None) -> Iterator[str]:
    """Paths relative to ``root`` of every entry below it that is not a folder (a link to nothing
    included: callers name it), hidden and underscore names left out, links followed. A folder whose
    real path was walked already (a link to an ancestor, or a second link to one folder) is walked
    once: a loop would never end, and a folder read twice would repeat its rows. A folder that
    cannot be listed raises ``refuse(error)``: os.walk would skip it without a word. Each hidden or
    underscore folder left out is passed to ``on_skipped_folder`` (relative to ``root``)."""
    walked: set[str] = set()

    def on_error(error: OSError) -> None:
        raise refuse(error) from error

    for folder, subfolders, names in os.walk(root, onerror=on_error, followlinks=True):
        real = os.path.realpath(folder)
        if real in walked:
            log.info("source %s: %s is a link to %s, which is read already", root, folder, real)
            subfolders.clear()
            continue
        walked.add(real)
        relative_folder = PurePosixPath(Path(folder).relative_to(root).as_posix())
        if on_skipped_folder is not None:
            for name in sorted(name for name in subfolders if is_hidden_or_underscore(name)):
                on_skipped_folder((relative_folder / name).as_posix())
        subfolders[:] = sorted(name for name in subfolders if not is_hidden_or_underscore(name))  # first link wins
        yield from ((relative_folder / name).as_posix() for name in names if not is_hidden_or_underscore(name))


def is_link_to_nothing(path: str | Path) -> bool:
    return os.path.islink(path) and not os.path.exists(path)


def link_to_nothing(shown: str, link: str | Path) -> str:
    """What to say of a link whose target is gone: the file it stood for would go unread."""
    return (f"{shown}: a link to {os.readlink(link)}, which leads to no file (its target is gone, or links "
            "loop); restore the target or remove the link")
