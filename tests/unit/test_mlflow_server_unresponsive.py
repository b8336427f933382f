"""An MLflow tracking server that accepts connections but never answers fails a step in bounded time,
with an error that says what to fix, instead of holding it ~20 minutes per MLflow call (MLflow's
defaults: 120 s a request, 7 retries).

- At setup, the mlflow_tracker resource refuses such a server with a ConfigError naming
  `mlflow_tracker.tracking_uri`.
- Tessera bounds MLflow's HTTP budget for a server URI, keeping an operator's own values.
- A server that stops answering mid-run costs the run's ending at most one waiting call: the step
  fails with the run's own error (or says where the unrecorded model is), and the MLflow run stays
  RUNNING for the next training's sweep, warned about.

The "server" that never answers is a listening socket nothing accepts from: the kernel completes each
connection, so a client waits out its read timeout, and the connections it made are counted afterwards."""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path

import pytest

import training_core.train.launcher as launcher
from training_core.errors import ConfigError, TrainingDivergedError
from training_core.runs import TrainingInputs, run_tracked_training
from training_core.tracking import MLFLOW_HTTP_BUDGET, MlflowTracking, RunNotRecordedError
from training_core.train.config import TrainingConfig
from training_core.train.result import TrainingResult

# Starlette deprecating a module MLflow's server imports as it serves: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:starlette.middleware.wsgi is deprecated")


class NeverAnswers:
    """Listens on ``port`` (any free one for 0), never reads nor answers."""

    def __init__(self, port: int = 0):
        self.socket = socket.socket()
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port a server just left
        self.socket.bind(("127.0.0.1", port))
        self.socket.listen(64)
        self.uri = f"http://127.0.0.1:{self.socket.getsockname()[1]}"

    def connections(self) -> int:
        """How many connections clients opened since the last count (each one a try that waited)."""
        self.socket.setblocking(False)
        count = 0
        while True:
            try:
                connection, _ = self.socket.accept()
            except BlockingIOError:
                return count
            connection.close()
            count += 1

    def close(self) -> None:
        self.socket.close()


@pytest.fixture
def never_answers():
    server = NeverAnswers()
    yield server
    server.close()


@pytest.fixture
def small_http_budget(monkeypatch):
    """An operator's budget of one try of 1 s: every waiting call is one connection, over in a second."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")


def test_a_server_that_accepts_but_never_answers_is_refused_at_setup_naming_the_setting(
        never_answers, small_http_budget, tmp_path):
    from resources import MlflowTracker, TesseraStorage

    tracker = MlflowTracker(storage=TesseraStorage(home=str(tmp_path)), tracking_uri=never_answers.uri)
    with pytest.raises(ConfigError, match=rf"^mlflow_tracker.tracking_uri '{never_answers.uri}': the server accepted "
                                          r"a connection but answered no HTTP request \(GET /health\) within 1 s "
                                          r"\(ReadTimeoutError: .*Read timed out"):
        tracker.client()
    assert never_answers.connections() == 2  # the check that it listens, and one GET: not retried


def test_the_http_budget_is_bounded_for_a_server_and_an_operators_own_values_are_kept(monkeypatch):
    from training_core.tracking import bound_mlflow_http_requests

    for name in MLFLOW_HTTP_BUDGET:
        monkeypatch.setenv(name, "")  # restored (unset) after the test
        monkeypatch.delenv(name)

    assert bound_mlflow_http_requests("sqlite:////data/mlflow.db") == 120  # MLflow's own: no server to wait for
    assert not any(name in os.environ for name in MLFLOW_HTTP_BUDGET)
    assert bound_mlflow_http_requests("https://mlflow.example:5000") == 30
    assert {name: os.environ[name] for name in MLFLOW_HTTP_BUDGET} == {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "30", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "2"}

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "300")  # a slow server's operator knows better
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7")
    assert bound_mlflow_http_requests("http://mlflow:5000") == 300
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "7"


class MlflowServer:
    """MLflow's own tracking server (its Flask app) in a thread, over a SQLite store; `stop_answering`
    turns its port into one that accepts and never answers, as a hung server does."""

    def __init__(self, monkeypatch, folder: Path):
        from mlflow.server import app, handlers
        from werkzeug.serving import WSGIRequestHandler, make_server

        self.monkeypatch = monkeypatch
        # Answers in time while it answers, on a machine as busy as it gets (no retries, see small_http_budget).
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
        monkeypatch.setenv("_MLFLOW_SERVER_FILE_STORE", f"sqlite:///{folder / 'server.db'}")
        monkeypatch.setenv("_MLFLOW_SERVER_ARTIFACT_ROOT", str(folder / "server-artifacts"))
        monkeypatch.setattr(handlers, "_tracking_store", None)  # built from the variables above
        monkeypatch.setattr(handlers, "_model_registry_store", None)
        handlers._get_tracking_store()  # its tables made now, not in the first request

        class OneRequestPerConnection(WSGIRequestHandler):
            protocol_version = "HTTP/1.0"  # no kept-alive connection outlives the server

            def log_request(self, *args):
                pass

        self.server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=OneRequestPerConnection)
        self.port = self.server.server_port
        self.uri = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.hung: NeverAnswers | None = None

    def stop_answering(self) -> NeverAnswers:
        """From here on each waiting call is one connection that waits 1 s (MLflow reads it per request)."""
        self.monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
        self.close()
        self.hung = NeverAnswers(self.port)
        return self.hung

    def close(self) -> None:
        if self.hung is not None:
            self.hung.close()
        elif self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()
            self.thread.join()


@pytest.fixture
def mlflow_server(small_http_budget, monkeypatch, tmp_path):  # its timeout over the small budget
    server = MlflowServer(monkeypatch, tmp_path / "server")
    yield server
    server.close()


def _train(tracking: MlflowTracking, demo_model, demo_dataset, tmp_path) -> None:
    inputs = TrainingInputs(base_model=demo_model.name_or_path, base_model_digest=demo_model.digest,
                            dataset_paths=[demo_dataset.path], dataset_digest="window", seq_len=64,
                            cache_directory=None, cache_version="cache", partition_keys=["2026-11-01"])
    run_tracked_training(TrainingConfig(), inputs, tracking, ray_storage=str(tmp_path / "ray"),
                         models_dir=tmp_path / "models")


def _run_started_by(caplog) -> str:
    [run_id] = [m.split()[2] for m in caplog.messages if m.startswith("MLflow run ") and " started: " in m]
    return run_id


@pytest.mark.parametrize("stop", [lambda: TrainingDivergedError("training loss became nan at step 7"),
                                  KeyboardInterrupt], ids=["training failed", "ctrl-c"])
def test_a_server_that_stops_answering_mid_run_costs_the_ending_one_wait_and_the_runs_error_is_raised(
        mlflow_server, monkeypatch, demo_model, demo_dataset, tmp_path, caplog, stop):
    error = stop()
    hung: list[NeverAnswers] = []

    def run_training(*args, **kwargs):
        hung.append(mlflow_server.stop_answering())
        raise error

    monkeypatch.setattr(launcher, "run_training", run_training)
    tracking = MlflowTracking(mlflow_server.uri, tmp_path / "artifacts")
    with caplog.at_level(logging.INFO), pytest.raises(type(error)) as raised:
        _train(tracking, demo_model, demo_dataset, tmp_path)
    assert raised.value is error  # not MLflow's error from ending the run
    # Recording why it ended waited once; ending it (get_run, then set_terminated) was not tried.
    assert hung[0].connections() == 1
    run_id = _run_started_by(caplog)
    [warning] = [m for m in caplog.messages if "stays RUNNING" in m]
    assert warning.startswith(f"MLflow run {run_id} stays RUNNING: the tracking server {mlflow_server.uri} gave no "
                              "answer (")
    assert warning.endswith("the next training marks it KILLED once this process has ended")
    assert not [m for m in caplog.messages if m.startswith(f"MLflow run {run_id} ended ")]


def test_a_finished_training_mlflow_did_not_record_names_its_model_and_does_not_wait_again(
        mlflow_server, monkeypatch, demo_model, demo_dataset, tmp_path, caplog):
    model_dir = tmp_path / "models" / "published"
    hung: list[NeverAnswers] = []

    def run_training(*args, **kwargs):
        model_dir.mkdir(parents=True)
        (model_dir / "adapter_config.json").write_text("{}")
        hung.append(mlflow_server.stop_answering())
        return TrainingResult(run_name="run", model_dir=str(model_dir), steps=2, restarts=0,
                              loss_history=[(0, 2.0), (1, 1.5)], telemetry={}, deepspeed_config={})

    monkeypatch.setattr(launcher, "run_training", run_training)
    tracking = MlflowTracking(mlflow_server.uri, tmp_path / "artifacts")
    with caplog.at_level(logging.INFO), pytest.raises(RunNotRecordedError) as raised:
        _train(tracking, demo_model, demo_dataset, tmp_path)
    run_id = _run_started_by(caplog)
    assert str(raised.value).startswith(
        f"MLflow run {run_id}: training finished and its model is published at {model_dir}, but it was not "
        f"recorded in MLflow at {mlflow_server.uri} (mlflow_tracker.tracking_uri): MlflowException: ")
    # Logging the results waited once; the run's ending knew from that error not to try.
    assert hung[0].connections() == 1
    assert [m for m in caplog.messages if m.startswith(f"MLflow run {run_id} stays RUNNING")]


def test_a_run_the_store_would_not_end_is_not_reported_ended(tmp_path, monkeypatch):
    """The failure tag is written but ending the run fails: the caller must not log 'ended FAILED'."""
    from mlflow.exceptions import MlflowException

    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    run_id = tracking.client.create_run(tracking.experiment_id).info.run_id

    def refused(*args, **kwargs):
        raise MlflowException("INTERNAL_ERROR: the store refused")

    monkeypatch.setattr(tracking.client, "set_terminated", refused)
    assert tracking.end_failed_run(run_id, RuntimeError("boom")) is False
    assert tracking.client.get_run(run_id).data.tags["tessera.failure"] == "RuntimeError: boom"


def test_a_server_whose_health_answer_is_503_is_a_server_that_answers(monkeypatch):
    """A proxy in front of MLflow answering 503 (a rolling deploy) is not 'a server that never answers'."""
    import http.server

    from resources.mlflow_tracker import _check_server_answers

    class Busy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _check_server_answers(f"http://127.0.0.1:{server.server_port}")  # raises ConfigError if refused
    finally:
        server.shutdown()
        server.server_close()
