"""Credentials in a source or tracking URI (a password in its userinfo, a signature in its query) are
used to read and connect, but never shown: not in messages, Dagster's event log, asset-check
descriptions or the origins saved beside the frozen records."""

from __future__ import annotations

import base64
import http.server
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from training_core.data.demo_task import generate_records
from training_core.data.sources import iter_records, list_source_files
from training_core.errors import ConfigError, SourceDataError
from training_core.redaction import redact_uri

PASSWORD = "FAKEPW_s3cr3t_9f8e7d"
SIGNATURE = "FAKESIG_0123abcd"


@pytest.mark.parametrize(("text", "shown"), [
    ("http://alice:pw@host:8080/a.jsonl", "http://alice:***@host:8080/a.jsonl"),
    ("postgresql+psycopg2://u:p@ss:w@db/mlflow", "postgresql+psycopg2://u:***@db/mlflow"),  # a raw "@" in it
    ("https://h/day.jsonl?X-Amz-Credential=AKIA&X-Amz-Signature=abc", "https://h/day.jsonl?X-Amz-Credential=***&X-Amz-Signature=***"),
    ("https://h/a.csv?sv=1&&sig=x%2F#part", "https://h/a.csv?sv=***&&sig=***#part"),
    ("https://h/a.csv?token", "https://h/a.csv?***"),  # an item without a name is all value
    ("line 3 of https://u:p@h/a.jsonl?sig=x: not valid JSON", "line 3 of https://u:***@h/a.jsonl?sig=***: not valid JSON"),
    ("url='http://h/a?sig=x'", "url='http://h/a?sig=***'"),
    ("s3://bucket/exports/day/a.jsonl", "s3://bucket/exports/day/a.jsonl"),
    ("https://ghp_TOKEN@h/a.jsonl", "https://***@h/a.jsonl"),  # a token alone is sent as the password
    ("abfs://exports@acct.dfs.core.windows.net/a.jsonl", "abfs://exports@acct.dfs.core.windows.net/a.jsonl"),
    ("http://alice:pa'ss(1)@h/a.jsonl", "http://alice:***@h/a.jsonl"),  # RFC 3986 allows ' and ( unencoded
    ("cannot open 'http://u:p@h/a.jsonl': 403", "cannot open 'http://u:***@h/a.jsonl': 403"),
    ("/data/exports/what?sig=x.jsonl", "/data/exports/what?sig=x.jsonl"),  # no scheme://: a local path
    ("data/alice:pw@host.jsonl", "data/alice:pw@host.jsonl"),
])
def test_redact_uri_hides_passwords_and_query_values_and_leaves_other_text_alone(text, shown):
    assert redact_uri(text) == shown


class _ExportServer(http.server.BaseHTTPRequestHandler):
    """Serves `files` (path -> bytes) at any query, only to requests with `authorization` (None: any).
    `refuse_ranges`: ranged GETs (reads) answer 403, as an expired presigned URL would."""

    files: dict[str, bytes] = {}
    authorization: str | None = None
    refuse_ranges = False

    def log_message(self, *args) -> None:
        pass

    def _answer(self, with_body: bool) -> None:
        body = self.files.get(self.path.split("?", 1)[0])
        if self.authorization and self.headers.get("Authorization") != self.authorization:
            self.send_response(401)
        elif body is None or (self.refuse_ranges and self.headers.get("Range")):
            self.send_response(404 if body is None else 403)
        else:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)
            return
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self) -> None:
        self._answer(with_body=False)

    def do_GET(self) -> None:
        self._answer(with_body=True)


@contextmanager
def _serving(files: dict[str, bytes], password: str | None = None, refuse_ranges: bool = False) -> Iterator[str]:
    """A local HTTP server (127.0.0.1 only) for `files`; yields its base URL, `alice:<password>@` in it."""
    basic = base64.b64encode(f"alice:{password}".encode()).decode() if password else None
    handler = type("Handler", (_ExportServer,), {"files": files, "authorization": basic and f"Basic {basic}",
                                                 "refuse_ranges": refuse_ranges})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        userinfo = f"alice:{password}@" if password else ""
        yield f"http://{userinfo}127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _jsonl(records: list[dict[str, str]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def test_a_presigned_url_is_read_by_the_suffix_of_its_path_not_of_its_query():
    with _serving({"/exports/2026-11-05.jsonl": _jsonl([{"prompt": "a", "response": "b"}])}) as base:
        url = f"{base}/exports/2026-11-05.jsonl?X-Amz-Credential=AKIAFAKE&X-Amz-Signature={SIGNATURE}"
        [file] = list_source_files(url)
        assert (file.suffix, file.format) == (".jsonl", "jsonl")
        assert str(file) == f"{base}/exports/2026-11-05.jsonl?X-Amz-Credential=***&X-Amz-Signature=***"
        assert list(iter_records(url)) == [{"prompt": "a", "response": "b"}]


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    while error is not None:
        yield error
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)


@pytest.mark.parametrize("case", ["missing", "unreadable", "malformed"])
def test_source_errors_name_the_file_without_its_credentials(case):
    files = {"/day.jsonl": b'{"prompt": "a", "response": "b"}\n' + (b"not json\n" if case == "malformed" else b"")}
    with _serving(files, PASSWORD, refuse_ranges=case == "unreadable") as base:
        url = f"{base}/{'gone' if case == 'missing' else 'day'}.jsonl?sig={SIGNATURE}"
        with pytest.raises(SourceDataError) as caught:
            list(iter_records(url))
    shown = redact_uri(url)
    assert "alice:***@" in shown and "sig=***" in shown
    assert str(caught.value).startswith({"missing": f"source path {shown} does not exist",
                                         "unreadable": f"{shown}: cannot be read (",
                                         "malformed": f"line 2 of {shown}: not valid JSON"}[case])
    # What chains it is shown too: in a traceback, and in Dagster's event log.
    for error in _chain(caught.value):
        assert PASSWORD not in str(error) and SIGNATURE not in str(error), repr(error)


def test_raw_examples_from_a_uri_with_credentials_keeps_them_out_of_logs_checks_and_origins(tmp_path):
    """Read for real (the server refuses requests without the password), then every event, check
    description and file Dagster and Tessera wrote is searched for the password and the signature.
    The source is given through an environment variable, as for any secret: Dagster keeps its name."""
    import dagster as dg

    from pipelines.graph import ASSETS
    from pipelines.resources_local import local_resources

    distinct = list({(r["prompt"], r["response"]): r for r in generate_records("2026-11-05", 400)}.values())[:300]
    exported_twice = _jsonl(distinct[:150] * 2)  # no_duplicate_rows fails, naming the repeated lines
    home = tmp_path / "home"
    (home / "dagster").mkdir(parents=True)
    with _serving({"/exports/2026-11-05.jsonl": exported_twice}, PASSWORD) as base, pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESSERA_HOME", str(home))
        mp.setenv("TESSERA_TEST_SOURCE", f"{base}/exports/{{partition}}.jsonl?sig={SIGNATURE}")
        with dg.DagsterInstance.local_temp(str(home / "dagster")) as instance:
            result = dg.materialize(
                ASSETS, selection=["base_model", "raw_examples", "training_dataset"], partition_key="2026-11-05",
                resources=local_resources(), instance=instance, raise_on_error=False,
                run_config={"ops": {"raw_examples": {"config": {"source": {"env": "TESSERA_TEST_SOURCE"}}}}})
            messages = [entry.message for entry in instance.all_logs(result.run_id)]  # context.log's too
        shown = f"{base.replace(PASSWORD, '***')}/exports/2026-11-05.jsonl?sig=***"

    assert result.output_for_node("raw_examples").records == 300  # read with the credentials
    [check] = [c for c in result.get_asset_check_evaluations() if c.check_name == "no_duplicate_rows"]
    assert not check.passed and f"line 151 of {shown} repeats line 1 of {shown}" in check.description
    assert any(f"partition 2026-11-05: 300 records from {shown}" in message for message in messages)
    [origins] = home.rglob(".origins.json")
    assert json.loads(origins.read_text())["files"] == [[shown, "line"]]

    def leaks(text: str) -> bool:
        return PASSWORD in text or SIGNATURE in text

    assert not [m for m in messages if leaks(m)]
    written = [p for p in home.rglob("*") if p.is_file() and leaks(p.read_bytes().decode("utf-8", "replace"))]
    assert not written, written  # event log, compute logs, frozen records and their origins


def test_tracking_uri_errors_name_the_uri_without_its_password(monkeypatch):
    import socket

    from resources import mlflow_tracker
    from resources.mlflow_tracker import check_tracking_uri

    monkeypatch.setattr(mlflow_tracker, "SERVER_CONNECT_TIMEOUT_S", 0.2)
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        refusals: list[Callable[[], None]] = [
            lambda: check_tracking_uri(f"https://admin:{PASSWORD}@127.0.0.1:{port}"),
            lambda: check_tracking_uri(f"mlflow://admin:{PASSWORD}@127.0.0.1:{port}"),
            lambda: check_tracking_uri(f"sqlite:////nonexistent/dir/mlflow.db?password={PASSWORD}"),
            lambda: check_tracking_uri(f"https://127.0.0.1:{port}/?token={PASSWORD}"),
            lambda: check_tracking_uri(f"https://admin:pa/{PASSWORD}@127.0.0.1:{port}"),  # a raw "/" in it
        ]
        messages = []
        for refuse in refusals:
            with pytest.raises(ConfigError) as caught:
                refuse()
            messages.append(str(caught.value))
    # In the URI, MLflow's own errors would print it: refused before anything connects.
    assert messages[0] == (f"mlflow_tracker.tracking_uri 'https://admin:***@127.0.0.1:{port}': carries credentials "
                           "(a password or token), which MLflow's errors would print; set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
                           "(or MLFLOW_TRACKING_TOKEN) instead")
    assert messages[4] == messages[0]
    assert messages[3].startswith(f"mlflow_tracker.tracking_uri 'https://127.0.0.1:{port}/?token=***': "
                                  f"no MLflow server accepted a connection at 127.0.0.1:{port}")
    assert messages[1].startswith(f"mlflow_tracker.tracking_uri 'mlflow://admin:***@127.0.0.1:{port}': expected")
    assert messages[2].startswith("mlflow_tracker.tracking_uri 'sqlite:////nonexistent/dir/mlflow.db?password=***': "
                                  "folder /nonexistent/dir does not exist")
    assert not [m for m in messages if PASSWORD in m]


# The token stands for a credential in the query; SQLite itself has no use for it (SQLAlchemy says so).
@pytest.mark.filterwarnings("ignore:Query string argument")
def test_the_restore_command_for_a_deleted_experiment_shows_the_tracking_uri_redacted(tmp_path):
    from mlflow.tracking import MlflowClient

    from training_core.tracking import MlflowTracking

    database = tmp_path / "mlflow.db"
    store = f"sqlite:///{database}"
    client = MlflowClient(store)
    client.delete_experiment(client.create_experiment("tessera", artifact_location=tmp_path.as_uri()))
    with pytest.raises(ConfigError) as caught:
        MlflowTracking(f"{store}?token={PASSWORD}", tmp_path / "artifacts")
    message = str(caught.value)
    assert PASSWORD not in message
    assert f"`MLFLOW_TRACKING_URI={store}?token=*** mlflow experiments restore --experiment-id" in message
    assert "(with MLFLOW_TRACKING_URI as configured where this shows ***)" in message
