"""An HTTP source that accepts connections and never answers fails within the storage request timeout,
with a message that says it timed out (a TimeoutError prints as an empty string)."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.silent_server import silent_http_server
from training_core.data import source_files
from training_core.data.source_files import redacted_cause
from training_core.data.sources import iter_records
from training_core.errors import SourceDataError


@pytest.fixture
def silent_server():
    with silent_http_server() as server:
        yield server.url


def test_a_timeout_is_named_though_its_text_is_empty():
    assert redacted_cause(TimeoutError()) == "timed out: TimeoutError"
    assert redacted_cause(KeyError()) == "KeyError"


def test_an_http_source_that_never_answers_fails_within_the_request_timeout(silent_server, monkeypatch):
    monkeypatch.setattr(source_files, "HTTP_REQUEST_TIMEOUT_S", 0.5)
    outcome: dict[str, object] = {}

    def list_records() -> None:
        started = time.monotonic()
        try:
            sum(1 for _ in iter_records(f"{silent_server}/day/"))
        except Exception as error:  # noqa: BLE001 - judged below
            outcome["error"] = error
        outcome["elapsed_s"] = time.monotonic() - started

    # in a thread: without a bounded timeout the listing would wait aiohttp's 300 s
    listing = threading.Thread(target=list_records, daemon=True)
    listing.start()
    listing.join(30)
    assert not listing.is_alive(), "listing a silent HTTP server did not give up within 30 s"
    error = outcome["error"]
    assert isinstance(error, SourceDataError)
    assert f"source {silent_server}/day/: cannot be listed (timed out" in str(error)
    assert "no answer within 0.5 s" in str(error)
    assert outcome["elapsed_s"] < 10


class _SlowlyStreamedFile(BaseHTTPRequestHandler):
    """A JSONL file of unknown size (chunked, no Content-Length: fsspec reads it in one GET) whose lines
    arrive 0.1 s apart, 1.2 s in all: a slow link, never silent for long."""

    protocol_version = "HTTP/1.1"
    LINES = 12

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.end_headers()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for index in range(self.LINES):
            line = (json.dumps({"prompt": f"q{index}", "response": f"a{index}"}) + "\n").encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()
            time.sleep(0.1)  # the link's pace, not synchronization: the reader waits on the socket
        self.wfile.write(b"0\r\n\r\n")


def test_a_file_streamed_for_longer_than_the_request_timeout_is_read_while_its_bytes_keep_coming(monkeypatch):
    monkeypatch.setattr(source_files, "HTTP_REQUEST_TIMEOUT_S", 0.5)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowlyStreamedFile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        records = list(iter_records(f"http://127.0.0.1:{server.server_address[1]}/day.jsonl"))
    finally:
        server.shutdown()
        server.server_close()
    assert len(records) == _SlowlyStreamedFile.LINES


class _StallsAfterItsHeaders(_SlowlyStreamedFile):
    """A file whose server sends its headers, then nothing more (a stuck upstream behind a proxy)."""

    released = threading.Event()  # set when the test ends, so the handler thread returns

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        self.released.wait(60)


def test_a_file_that_falls_silent_after_its_headers_fails_within_the_request_timeout(monkeypatch):
    monkeypatch.setattr(source_files, "HTTP_REQUEST_TIMEOUT_S", 0.5)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StallsAfterItsHeaders)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    outcome: dict[str, object] = {}

    def read() -> None:
        try:
            list(iter_records(f"http://127.0.0.1:{server.server_address[1]}/day.jsonl"))
        except Exception as error:  # noqa: BLE001 - judged below
            outcome["error"] = error

    reader = threading.Thread(target=read, daemon=True)  # without sock_read the read never ends
    reader.start()
    reader.join(20)
    _StallsAfterItsHeaders.released.set()
    server.shutdown()
    server.server_close()
    assert not reader.is_alive(), "reading a file that fell silent did not give up within 20 s"
    assert isinstance(outcome["error"], SourceDataError)
    assert "timed out" in str(outcome["error"]), outcome["error"]
