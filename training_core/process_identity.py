"""Which process started a piece of work, recorded so that a later process can tell whether it is
still running: host, PID and when the process started (a PID alone is reused by the OS).

On Linux the start is ``<start ticks>@<boot id>``: the kernel's clock ticks from boot to the process's
start (field 22 of /proc/<pid>/stat) and the boot's id without dashes. Neither moves with the wall
clock, whereas psutil's ``create_time()`` adds /proc/stat's boot time, which the kernel recomputes
from the wall clock: an NTP step or a VM resume would shift a live process's start and call it gone.
Elsewhere it is psutil's ``create_time()`` (``1733552341.123``), as every identity was before; those
are still compared that way. The start field holds neither ':' (identities are read from the right)
nor '-' (checkpoint staging folder names are too)."""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

import psutil

_BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")
_BOOT_MARK = "@"
_START_TICKS_FIELD = 22  # of /proc/<pid>/stat, numbered from 1 (proc(5))


class _NoSuchProcess(Exception):
    pass


@functools.cache
def _boot_id() -> str | None:
    """This boot's id (dashes left out), or None where the system has none to read (not Linux)."""
    try:
        return _BOOT_ID_FILE.read_text().strip().replace("-", "") or None
    except OSError:
        return None


def _start_ticks(pid: int) -> str:
    """Clock ticks from boot to the start of process `pid`; raises _NoSuchProcess where it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError) as error:
        raise _NoSuchProcess(pid) from error
    # Fields 3 on follow the command name in parentheses, which may itself hold spaces and ')'.
    return stat[stat.rindex(")") + 1:].split()[_START_TICKS_FIELD - 3]


def _wall_clock_start(pid: int) -> str:
    try:
        return f"{psutil.Process(pid).create_time():.3f}"
    except psutil.NoSuchProcess as error:
        raise _NoSuchProcess(pid) from error


def this_process() -> str:
    """``<host>:<pid>:<start>`` of the calling process."""
    pid = os.getpid()
    boot = _boot_id()
    start = f"{_start_ticks(pid)}{_BOOT_MARK}{boot}" if boot else _wall_clock_start(pid)
    return f"{socket.gethostname()}:{pid}:{start}"


def process_is_gone(identity: str) -> bool:
    """True only when the process certainly no longer runs: same host, and its PID is free or now
    belongs to a process started at another time, or the host has rebooted since. A process on
    another host is never judged from here, nor a value `this_process` did not write."""
    parts = identity.split(":")
    if len(parts) < 3 or not parts[-2].isdigit():
        return False
    host, pid, started = ":".join(parts[:-2]), int(parts[-2]), parts[-1]
    if host != socket.gethostname():
        return False
    try:
        if _BOOT_MARK in started:
            ticks, boot = started.split(_BOOT_MARK, 1)
            if (this_boot := _boot_id()) is None:
                return False  # cannot tell: this host has no boot id to compare with
            return boot != this_boot or _start_ticks(pid) != ticks
        try:
            float(started)
        except ValueError:
            return False
        return _wall_clock_start(pid) != started  # written before boot ids were recorded
    except _NoSuchProcess:
        return True
