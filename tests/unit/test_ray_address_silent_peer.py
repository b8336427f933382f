"""A Ray address where something accepts TCP connections but never answers (a wrong port on a service
that waits for its client to speak first, a port-forward with nothing behind it) fails within
connect_timeout_s, naming the setting; before, the TCP check passed and ray.init retried for over ten
minutes. The check dials what ray.init dials: Ray replaces 127.0.0.1 with this machine's node IP."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent import futures

import dagster as dg
import pytest
from ray._private.services import resolve_ip_for_localhost

from resources.ray_cluster import ExternalRayCluster, RayClusterUnreachable, wait_until_reachable

NODE_IP = resolve_ip_for_localhost("127.0.0.1")  # where ray.init("127.0.0.1:PORT") connects


def _grpc_server(host: str) -> Iterator[int]:
    """A gRPC server, as Ray's GCS and Ray Client servers are."""
    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    yield port
    server.stop(grace=None)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port on every interface (like a database's) whose connections the kernel completes and nobody
    ever reads or answers."""
    with socket.create_server(("0.0.0.0", 0), backlog=16) as listener:
        yield listener.getsockname()[1]


@pytest.fixture
def grpc_port() -> Iterator[int]:
    yield from _grpc_server("0.0.0.0")


@pytest.fixture
def loopback_only_grpc_port() -> Iterator[int]:
    """As `kubectl port-forward` listens: on 127.0.0.1 only."""
    yield from _grpc_server("127.0.0.1")


def test_a_silent_peer_fails_the_check_naming_the_setting(silent_port):
    with pytest.raises(RayClusterUnreachable) as refused:
        wait_until_reachable(f"127.0.0.1:{silent_port}", timeout_s=1)
    message = str(refused.value)
    assert message.startswith(f"Ray address 127.0.0.1:{silent_port} (TESSERA_RAY_ADDRESS or ray_cluster.address): "
                              f"port {silent_port} accepted the connection but did not answer as Ray's GCS "
                              "(gRPC over HTTP/2) within 1 s (ray_cluster.connect_timeout_s)")
    assert "Ray connects to the head node's GCS address HOST:6379" in message


def test_a_silent_ray_client_port_fails_the_check(silent_port):
    with pytest.raises(RayClusterUnreachable, match=r"did not answer as Ray's Ray Client server \(gRPC over HTTP/2\) "
                                                    r"within 0.5 s \(ray_cluster.connect_timeout_s\)"):
        wait_until_reachable(f"ray://127.0.0.1:{silent_port}", timeout_s=0.5)


def test_the_external_cluster_fails_its_connect_before_ray_init(silent_port, monkeypatch):
    import ray

    def ray_init(*args, **kwargs):
        raise AssertionError("ray.init reached: it retries a silent peer for minutes")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh step process
    monkeypatch.setattr(ray, "init", ray_init)
    cluster = ExternalRayCluster(address=f"127.0.0.1:{silent_port}", connect_timeout_s=1)
    with pytest.raises(RayClusterUnreachable, match=r"did not answer as Ray's GCS .* within 1 s"):
        cluster.connect(dg.build_init_resource_context())


@pytest.mark.skipif(NODE_IP == "127.0.0.1", reason="Ray dials 127.0.0.1 itself on this machine")
def test_a_server_on_the_loopback_only_is_not_what_ray_reaches(loopback_only_grpc_port):
    port = loopback_only_grpc_port
    with pytest.raises(RayClusterUnreachable) as refused:
        wait_until_reachable(f"127.0.0.1:{port}", timeout_s=0.5)
    assert "did not accept a connection within 0.5 s: " in str(refused.value)
    assert f"(Ray dials {NODE_IP}:{port}, this machine's node IP, for 127.0.0.1)" in str(refused.value)
    wait_until_reachable(f"ray://127.0.0.1:{port}", timeout_s=5)  # a Ray Client dials the host as written


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_a_grpc_server_passes_the_check(grpc_port, scheme):
    wait_until_reachable(f"{scheme}127.0.0.1:{grpc_port}", timeout_s=5)


_EMPTY_SETTINGS_FRAME = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # what a gRPC server sends first


def _late_or_slow_grpc_peer(port: int, listen_after_s: float, answer_after_s: float, stop) -> None:
    """A head node that starts listening `listen_after_s` late, then answers each preface `answer_after_s`
    late (the delays are what is simulated, not a wait for the other side)."""
    import threading
    import time

    time.sleep(listen_after_s)
    with socket.create_server(("0.0.0.0", port), backlog=16) as listener:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                peer, _ = listener.accept()
            except TimeoutError:
                continue

            def answer(peer=peer):
                with peer:
                    time.sleep(answer_after_s)
                    try:
                        peer.recv(64)
                        peer.sendall(_EMPTY_SETTINGS_FRAME)
                        peer.recv(64)  # until the client closes
                    except OSError:
                        pass
            threading.Thread(target=answer, daemon=True).start()


@pytest.mark.parametrize("listen_after_s, answer_after_s", [(3.5, 0), (0, 3)], ids=["starts-late", "answers-late"])
def test_a_head_node_starting_or_answering_late_passes_within_connect_timeout(listen_after_s, answer_after_s):
    """connect_timeout_s is the whole wait, not a 2 s protocol check: a head node still starting, or a busy
    GCS, is not refused as silent (the refusal says 'within {connect_timeout_s} s')."""
    import threading

    with socket.create_server(("0.0.0.0", 0)) as probe:
        port = probe.getsockname()[1]
    stop = threading.Event()
    threading.Thread(target=_late_or_slow_grpc_peer, args=(port, listen_after_s, answer_after_s, stop),
                     daemon=True).start()
    try:
        wait_until_reachable(f"127.0.0.1:{port}", timeout_s=15)
    finally:
        stop.set()
