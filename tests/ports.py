"""Loopback ports for servers a test starts in another process (`dagster dev`, `ray start`)."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range. A port the kernel handed out (bind to
    0) is free again once released, and the next process asking for any port may get it before the
    server meant to bind it does: under xdist, a gRPC server (Dagster's code server, Ray's) answered
    `dagster dev`'s first GraphQL request in HTTP/2 (http.client.BadStatusLine)."""
    low = _ephemeral_port_range()[0]
    for port in random.Random().sample(range(max(1024, low - 12000), low), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port below {low}")


def _ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):  # not Linux: the IANA range
        return 49152, 65535
