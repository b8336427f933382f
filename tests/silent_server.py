"""A local TCP server that accepts every connection and never sends a byte: an HTTP source that hangs."""
from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class SilentServer:
    url: str
    connected: threading.Event = field(default_factory=threading.Event)  # set once a client has connected


@contextlib.contextmanager
def silent_http_server() -> Iterator[SilentServer]:
    listener = socket.create_server(("127.0.0.1", 0))
    server = SilentServer(f"http://127.0.0.1:{listener.getsockname()[1]}")
    held: list[socket.socket] = []

    def accept_forever() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:  # the listener was closed
                return
            server.connected.set()

    threading.Thread(target=accept_forever, name="silent-server", daemon=True).start()
    try:
        yield server
    finally:
        listener.close()
        for connection in held:
            connection.close()
