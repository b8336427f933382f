"""Which process started a piece of work, recorded so that a later process can tell whether it is
still running: host, PID and process start time (a PID alone is reused by the OS)."""

from __future__ import annotations

import os
import socket

import psutil


def this_process() -> str:
    """``<host>:<pid>:<start time>`` of the calling process."""
    return f"{socket.gethostname()}:{os.getpid()}:{psutil.Process().create_time():.3f}"


def process_is_gone(identity: str) -> bool:
    """True only when the process certainly no longer runs: same host, and its PID is free or now
    belongs to a process started at another time. A process on another host is never judged from
    here, nor a value `this_process` did not write."""
    parts = identity.split(":")
    if len(parts) < 3 or not parts[-2].isdigit():
        return False
    host, pid, started = ":".join(parts[:-2]), int(parts[-2]), parts[-1]
    if host != socket.gethostname():
        return False
    try:
        return f"{psutil.Process(pid).create_time():.3f}" != started
    except psutil.NoSuchProcess:
        return True
