"""A Ray dashboard or Jobs API address in TESSERA_RAY_ADDRESS is refused at once, naming the addresses
Ray takes; before, a URL failed at DNS after connect_timeout_s and HOST:8265 hung in ray.init for minutes."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from resources.ray_cluster import ExternalRayCluster, RayClusterUnreachable, wait_until_reachable

ADDRESSES_RAY_TAKES = (r"Ray connects to the head node's GCS address HOST:6379 or its Ray Client address "
                       r"ray://HOST:10001, not to the dashboard / Jobs API URL that `ray job submit` takes")


@pytest.mark.parametrize("address", ["http://127.0.0.1:8265", "https://ray-head:8265"])
def test_a_dashboard_url_is_refused_by_the_address_check(address):
    with pytest.raises(ValueError, match=rf"Ray address '{address}' \(TESSERA_RAY_ADDRESS or ray_cluster.address\) "
                                         rf"is a URL \(https?://\); {ADDRESSES_RAY_TAKES}"):
        ExternalRayCluster(address=address)


@pytest.fixture
def python_http_server() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def aiohttp_server() -> Iterator[int]:
    """An aiohttp server, as the Ray dashboard and Jobs API run on."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(web.Application())
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    threading.Thread(target=loop.run_forever, daemon=True).start()
    yield site._server.sockets[0].getsockname()[1]
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)


@pytest.mark.parametrize("server", ["python_http_server", "aiohttp_server"])
def test_an_http_server_at_the_address_is_refused_within_seconds(server, request):
    port = request.getfixturevalue(server)
    started = time.monotonic()
    with pytest.raises(RayClusterUnreachable, match=rf"Ray address 127.0.0.1:{port} \(TESSERA_RAY_ADDRESS or "
                       rf"ray_cluster.address\): port {port} is an HTTP server \(it answered 'HTTP/1.\d \d+ .*'\), "
                       rf"not Ray; {ADDRESSES_RAY_TAKES}"):
        wait_until_reachable(f"127.0.0.1:{port}", timeout_s=5)
    assert time.monotonic() - started < 5


@pytest.mark.integration  # starts Ray
def test_a_real_ray_gcs_address_passes_the_check(ray_session):
    from resources.ray_cluster import PeerAnswer, answer_to_grpc_preface

    gcs_address = ray_session.get_runtime_context().gcs_address
    host, _, port = gcs_address.rpartition(":")
    assert answer_to_grpc_preface(host, int(port)) == PeerAnswer()  # answered in HTTP/2, at once
    wait_until_reachable(gcs_address, timeout_s=5)


@pytest.mark.parametrize(("mode", "says"), [(None, "RAY_AUTH_MODE is not set here: it sent no token"),
                                            ("token", "it has RAY_AUTH_MODE=token, but its token is missing"),
                                            ("disabled", "RAY_AUTH_MODE is 'disabled' here: it sent no token")])
def test_the_token_refusal_says_what_this_process_sent(monkeypatch, mode, says):
    from resources.ray_cluster import _token_refusal

    if mode is None:
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    else:
        monkeypatch.setenv("RAY_AUTH_MODE", mode)
    assert says in _token_refusal("10.0.0.1:6379")


def _connection_error_from(inner: Exception, *, explicit: bool) -> ConnectionError:
    """Ray's ConnectionError naming only the address, raised from (or during) the error behind it."""
    try:
        try:
            raise inner
        except Exception as error:
            if explicit:
                raise ConnectionError("Failed to connect to Ray cluster at h:1") from error
            raise ConnectionError("Failed to connect to Ray cluster at h:1")  # noqa: B904 - Ray's own shape
    except ConnectionError as outer:
        return outer


def test_a_token_refusal_is_recognised_as_an_exception_or_as_text_anywhere_in_the_chain():
    from ray.exceptions import AuthenticationError

    from resources.ray_cluster import refused_for_its_token

    assert refused_for_its_token(_connection_error_from(RuntimeError("RPC error: InvalidAuthToken: missing"),
                                                        explicit=True))
    assert refused_for_its_token(_connection_error_from(AuthenticationError("bad token"), explicit=False))
    assert not refused_for_its_token(_connection_error_from(RuntimeError("GCS not ready"), explicit=True))
