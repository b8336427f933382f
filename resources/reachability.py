"""Is anything listening at a service's address? Asked before handing the address to a client
that retries a dead one for minutes (ray.init, MLflow's HTTP client), so a typo fails in seconds."""

import socket
import time


def connection_refusal(host: str, port: int, timeout_s: float, poll_s: float = 1.0) -> OSError | None:
    """None as soon as a TCP connection to ``host:port`` succeeds; otherwise keep trying every
    ``poll_s`` (the service may still be starting) and return the last error once ``timeout_s``
    has passed. ``poll_s >= timeout_s`` makes it one attempt."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return None
        except OSError as error:
            if time.monotonic() + poll_s > deadline:
                return error
            time.sleep(poll_s)
