"""MLflow tracking as a Dagster resource: SQLite + local artifacts by default, any server by URI."""


import dagster as dg
from pydantic import Field

from resources.paths import TesseraStorage
from training_core.errors import ConfigError
from training_core.redaction import redact_uri
from training_core.tracking import MlflowTracking, bound_mlflow_http_requests


class MlflowTracker(dg.ConfigurableResource):
    """MLflow tracking and registry for training runs (SQLite under $TESSERA_HOME unless a URI is set)."""

    storage: dg.ResourceDependency[TesseraStorage]
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; default sqlite:///<home>/mlflow.db. A server's credentials go in MLFLOW_TRACKING_USERNAME/PASSWORD, a database's via EnvVar."
    )
    experiment: str = Field("tessera", description="MLflow experiment name")
    ui_url: str = Field("http://127.0.0.1:5000", description="MLflow UI base URL, for links in Dagster")

    def client(self, create_missing: bool = True) -> MlflowTracking:
        """``create_missing=False``: see :class:`MlflowTracking` (the experiment is then not created)."""
        if not self.experiment.strip():  # MLflow's own refusal names no setting
            raise ConfigError(f"mlflow_tracker.experiment {self.experiment!r}: expected the name of the MLflow "
                              "experiment runs are logged to (default 'tessera')")
        uri = self.tracking_uri or f"sqlite:///{self.storage.root / 'mlflow.db'}"
        if self.tracking_uri:
            check_tracking_uri(self.tracking_uri)
        # Creates the state root too (SQLite needs its folder): a file in the way is a ConfigError,
        # as for every other resource, not a raw FileExistsError.
        artifacts = self.storage.folder("mlartifacts")
        return MlflowTracking(uri, artifacts, self.experiment, create_missing=create_missing)


def _refused(uri: str, problem: str):
    """The ConfigError naming the setting and the URI as shown (its credentials redacted)."""
    return ConfigError(f"mlflow_tracker.tracking_uri {redact_uri(uri)!r}: {problem}")


# Stores MLflow 3 serves runs and the model registry from (its file store is retired).
TRACKING_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks")


def check_tracking_uri(uri: str) -> None:
    """Refuse a tracking URI MLflow would misread or, for SQLite, quietly create somewhere new (a
    typo in the path would start an empty store: earlier runs, reuse and the champion gone)."""
    from urllib.parse import urlparse

    scheme = urlparse(uri).scheme.split("+")[0]
    if scheme not in TRACKING_SCHEMES:
        raise _refused(uri, f"expected a URI with scheme {'/'.join(TRACKING_SCHEMES)} (e.g. sqlite:////data/mlflow.db "
                            "or http://mlflow:5000)")
    if scheme in ("http", "https"):
        # as redaction reads it: urlparse takes a password holding a raw "/" (`https://admin:pa/ss@host`) for a path
        if "***@" in redact_uri(uri):
            # MLflow's own errors quote the server URI as given (a dropped connection mid-run would put
            # the password in Dagster's event log); the client reads credentials from these variables.
            raise _refused(uri, "carries credentials (a password or token), which MLflow's errors would print; set "
                                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) instead")
        _check_server_listens(uri, scheme)
        _check_server_answers(uri)
    if scheme == "sqlite":
        _check_sqlite_uri(uri, urlparse(uri).scheme)
    if scheme in ("postgresql", "mysql", "mssql"):
        _check_database_driver(uri)


def _check_database_driver(uri: str) -> None:
    """The Python driver SQLAlchemy opens a database store with is installed: without it the first
    MLflow call failed with "No module named 'psycopg'", which `tessera reproduce` took for a damaged store."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        make_url(uri).get_dialect().import_dbapi()
    except (ArgumentError, NoSuchModuleError, ImportError) as error:
        missing = getattr(error, "name", None)
        problem = (f"its database driver, the Python module {missing!r}, is not installed here; install it, or "
                   f"name an installed driver as scheme+driver://" if missing else f"no SQLAlchemy driver for it ({error})")
        raise _refused(uri, problem) from None


def _check_sqlite_uri(uri: str, scheme: str) -> None:
    """Only `sqlite:///<absolute file path>` names one database for every process: `sqlite://` and
    `sqlite:///:memory:` are in-memory databases (every run gone when the process ends), a relative path
    (`sqlite:///mlflow.db`, MLflow's quick-start spelling) is a store in each process's working directory
    (a run logged by one step is not found by the next), and `sqlite:/path` is no URL SQLAlchemy can parse."""
    from pathlib import Path

    prefix = f"{scheme}:///"
    database, _, query = (uri.removeprefix(prefix) if uri.startswith(prefix) else "").partition("?")
    if not database or database == ":memory:" or "mode=memory" in query:
        problem = ("names no database file, so SQLite would keep every run in memory and lose them when the "
                   "process ends" if uri.startswith(prefix) or uri.rstrip("/") == f"{scheme}:"
                   else "is not a SQLite URL MLflow can open")
        raise _refused(uri, f"{problem}; use sqlite:///<file path> (sqlite:////data/mlflow.db for /data/mlflow.db)")
    path = Path(database)
    if not path.is_absolute():
        raise _refused(uri, f"the database path {database!r} is relative, so each process would open the store in "
                            "its own working directory (a run logged by one step not found by the next); use an "
                            f"absolute path (four slashes): {prefix}{Path.cwd() / path} for {path} here, or "
                            "leave tracking_uri unset for <home>/mlflow.db")
    if not path.parent.is_dir():
        raise _refused(uri, f"folder {path.parent} does not exist")


SERVER_CONNECT_TIMEOUT_S = 30.0  # rides out a server restart; nothing listening fails in 30 s, not ~4 min


def _check_server_listens(uri: str, scheme: str) -> None:
    """MLflow's client retries a refused connection with backoff before it fails. Tries again each
    second for up to SERVER_CONNECT_TIMEOUT_S, so a server that is restarting (a rolling deploy) does
    not fail the step."""
    from urllib.parse import urlparse

    from resources.reachability import connection_refusal

    parsed = urlparse(uri)
    if not parsed.hostname:
        raise _refused(uri, "no host name")
    port = parsed.port or (443 if scheme == "https" else 80)
    if error := connection_refusal(parsed.hostname, port, SERVER_CONNECT_TIMEOUT_S):
        raise _refused(uri, f"no MLflow server accepted a connection at "
                            f"{parsed.hostname}:{port} within {SERVER_CONNECT_TIMEOUT_S:g} s ({error}); start it "
                            "(`mlflow server --port ...`) or fix the URI")


def _check_server_answers(uri: str) -> None:
    """A server that accepts connections but never answers (hung, or no HTTP server) would hold every
    MLflow call for the whole HTTP budget (`MLFLOW_HTTP_BUDGET`, retries included). One GET of MLflow's
    health endpoint, not retried, with the client's own credentials and TLS settings, finds it here.
    Any HTTP answer will do: a proxy's 401 or 404 is a server that answers."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request
    from requests.exceptions import Timeout
    from urllib3.exceptions import TimeoutError as PoolTimeout

    timeout_s = bound_mlflow_http_requests(uri)
    try:
        http_request(get_default_host_creds(uri), "/health", "GET", max_retries=0, timeout=timeout_s,
                     raise_on_status=False)
    except MlflowException as error:
        cause = error.__cause__ or error.__context__ or error
        cause = getattr(cause.args[0], "reason", cause) if cause.args else cause  # not "Max retries exceeded"
        waited = f" within {timeout_s:g} s" if isinstance(cause, (Timeout, PoolTimeout)) else ""
        raise _refused(uri, f"the server accepted a connection but answered no HTTP request (GET /health){waited} "
                            f"({type(cause).__name__}: {redact_uri(str(cause))}); is it an MLflow server, and is it "
                            "up? (MLFLOW_HTTP_REQUEST_TIMEOUT sets how long to wait)") from None
