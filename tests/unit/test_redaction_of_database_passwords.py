"""A password pasted raw into a URI may hold "/", "?", "#" or "@": SQLAlchemy still sends everything
from "user:" to the next "@" as the password, so what is shown hides all of it, never only the part
before the first "/". A URI whose authority is a host (with a port, or an IPv6 literal) is shown as
it was, even when an "@" follows in its path."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from training_core.errors import ConfigError
from training_core.redaction import redact_uri


@pytest.mark.parametrize(("uri", "shown"), [
    ("postgresql+psycopg2://mlflow:Zx8/k+Qw@db:5432/mlflow", "postgresql+psycopg2://mlflow:***@db:5432/mlflow"),
    ("postgresql://mlflow:a?b@db/mlflow?sslmode=require", "postgresql://mlflow:***@db/mlflow?sslmode=***"),
    ("mysql+pymysql://mlflow:se#cret@db/mlflow", "mysql+pymysql://mlflow:***@db/mlflow"),
    ("mysql://mlflow:p/w@x@db/mlflow", "mysql://mlflow:***@db/mlflow"),  # "/" and a raw "@" in one password
    ("mssql+pyodbc://sa:/?#@db/mlflow", "mssql+pyodbc://sa:***@db/mlflow"),
    ("postgresql://mlflow:2024/x@db/mlflow", "postgresql://mlflow:***@db/mlflow"),  # digits first: still no port
    ("postgresql+psycopg2://mlflow:2024/x@db/mlflow", "postgresql+psycopg2://mlflow:***@db/mlflow"),  # the chart's
])
def test_a_database_password_holding_uri_delimiters_is_hidden_whole(uri, shown):
    assert set(make_url(uri).password) & set("/?#@")  # what SQLAlchemy sends as the password holds one
    assert redact_uri(uri) == shown
    assert redact_uri(f"cannot connect to {uri!r}: refused") == f"cannot connect to {shown!r}: refused"


@pytest.mark.parametrize(("uri", "shown"), [
    ("https://alice:a/b@exports.example.com/day.jsonl", "https://alice:***@exports.example.com/day.jsonl"),
    ("https://alice:q?x#y@h/day.jsonl?sig=abc", "https://alice:***@h/day.jsonl?sig=***"),
    ("http://alice:a/b@c@h:8080/day.jsonl", "http://alice:***@h:8080/day.jsonl"),
    # userinfo without a delimiter, then an "@" in the path: the host and path are shown as they were
    ("https://alice:pw@h.example.com/users/bob@example.com/day.jsonl",
     "https://alice:***@h.example.com/users/bob@example.com/day.jsonl"),
])
def test_a_web_password_holding_uri_delimiters_is_hidden_whole(uri, shown):
    assert redact_uri(uri) == shown


@pytest.mark.parametrize("uri", [
    "http://minio:9000/exports/alice@example.com/day.jsonl",  # a port, then an "@" in the path
    "https://h/users/bob@example.com/day.jsonl",
    "http://[::1]:8080/exports/a@b.jsonl",
    "postgresql://db:5432/mlflow",
    "https://h:8443/day.jsonl#part",
    "https://exports.example.com#owner@team",  # "#" ends the authority too: what follows is no userinfo
])
def test_a_uri_whose_authority_is_a_host_is_shown_as_it_was(uri):
    assert redact_uri(uri) == uri


@pytest.mark.parametrize("uri", ["postgresql+nosuchdriver://mlflow:Zx8/k+Qw@db/mlflow",
                                 "mysql+nosuchdriver://mlflow:Se7#cret@db/mlflow"])
def test_a_refused_database_tracking_uri_is_named_without_its_password(uri):
    from resources.mlflow_tracker import check_tracking_uri

    with pytest.raises(ConfigError) as caught:
        check_tracking_uri(uri)
    message = str(caught.value)
    assert f"'{uri.split('://')[0]}://mlflow:***@db/mlflow'" in message
    assert "Zx8" not in message and "Se7" not in message  # not even the part before the delimiter
