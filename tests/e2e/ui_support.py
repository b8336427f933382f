"""Helpers for the browser test of the Dagster UI: start/stop `dagster dev`, GraphQL, Chromium.

The UI is driven as a person would use it: a real `dagster dev` (webserver, daemon, code server)
on a loopback port with its own TESSERA_HOME, and Debian's Chromium through Playwright.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil

from tests.ports import free_port

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
# Flags that keep Chromium off the network (this machine reaches only package registries).
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
TERMINAL_RUN_STATUSES = {"SUCCESS", "FAILURE", "CANCELED"}

T = TypeVar("T")


class ChromiumUnavailable(RuntimeError):
    """Chromium could not be installed or started; the browser test skips with this reason."""


class DagsterDevError(RuntimeError):
    """`dagster dev` exited, failed to load the code location, or did not answer in time."""


def artifacts_dir() -> Path:
    """Where screenshots and logs go: $TESSERA_ARTIFACTS_DIR, default tests/artifacts/ (git-ignored)."""
    path = Path(os.environ.get("TESSERA_ARTIFACTS_DIR") or REPO_ROOT / "tests" / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def poll(what: str, probe: Callable[[], T | None], timeout_s: float, interval_s: float = 1.0) -> T:
    """Call `probe` until it returns something other than None; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached within {timeout_s:.0f} s")
        time.sleep(interval_s)


# ---------------------------------------------------------------- dagster dev


@dataclass
class DagsterDev:
    """A running `dagster dev`; `graphql()` talks to its webserver."""

    process: subprocess.Popen
    url: str
    tessera_home: Path
    log_path: Path
    location_name: str = ""
    repository_name: str = ""
    # psutil handles, not bare pids: psutil refuses to signal a pid that was reused meanwhile.
    _descendants: dict[int, psutil.Process] = field(default_factory=dict)

    def graphql(self, query: str, variables: dict | None = None, timeout_s: float = 30.0) -> dict:
        """POST a GraphQL query; return `data`, raising on transport or GraphQL errors."""
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        request = urllib.request.Request(
            f"{self.url}/graphql", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            payload = json.load(response)
        if payload.get("errors"):
            raise AssertionError(f"GraphQL errors: {json.dumps(payload['errors'])[:2000]}")
        return payload["data"]

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no dagster dev log)"

    def remember_descendants(self) -> None:
        """Record every process below `dagster dev` (run workers, Ray) so `stop()` can end them
        even if they moved to their own process group or lost their parent."""
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for child in children:
            self._descendants.setdefault(child.pid, child)


def write_instance_settings(dagster_home: Path) -> None:
    """The instance `make ui` runs on (telemetry and the "join the community" dialog off, the
    training pool limit, run monitoring), so the browser tests exercise what users get."""
    from pipelines.instance import INSTANCE_SETTINGS

    dagster_home.mkdir(parents=True, exist_ok=True)
    (dagster_home / "dagster.yaml").write_text(INSTANCE_SETTINGS)


def start_dagster_dev(tessera_home: Path, log_path: Path, port: int | None = None) -> DagsterDev:
    """Start `dagster dev -w workspace.yaml` in its own process group with a fresh state directory
    laid out as `tessera demo` does (DAGSTER_HOME = $TESSERA_HOME/dagster)."""
    port = port or free_port()
    dagster_home = tessera_home / "dagster"
    write_instance_settings(dagster_home)
    env = dict(os.environ)
    env.update({
        "TESSERA_HOME": str(tessera_home),
        "DAGSTER_HOME": str(dagster_home),
        "DAGSTER_DISABLE_TELEMETRY": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "DS_ACCELERATOR": env.get("DS_ACCELERATOR", "cpu"),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    })
    command = [sys.executable, "-m", "dagster", "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)]
    log_file = log_path.open("wb")
    try:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log_file,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
    finally:
        log_file.close()  # the child holds its own copy of the descriptor
    log.info("dagster dev pid %s on port %s, log %s", process.pid, port, log_path)
    return DagsterDev(process=process, url=f"http://127.0.0.1:{port}", tessera_home=tessera_home, log_path=log_path)


WORKSPACE_QUERY = """
{ workspaceOrError { __typename
    ... on Workspace { locationEntries { name loadStatus
        locationOrLoadError { __typename
          ... on RepositoryLocation { name repositories { name } }
          ... on PythonError { message stack } } } }
    ... on PythonError { message } } }
"""


def wait_until_ready(dev: DagsterDev, timeout_s: float) -> None:
    """Poll the webserver until its code location has loaded (server_info answering is not
    enough: the location loads after the webserver starts)."""

    def probe() -> bool | None:
        if dev.process.poll() is not None:
            raise DagsterDevError(f"dagster dev exited with {dev.process.returncode}:\n{dev.log_tail()}")
        try:
            data = dev.graphql(WORKSPACE_QUERY, timeout_s=10)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return None  # webserver not listening yet
        entries = data["workspaceOrError"].get("locationEntries") or []
        for entry in entries:
            location = entry.get("locationOrLoadError") or {}
            if location.get("__typename") == "PythonError":
                raise DagsterDevError(f"code location {entry['name']} failed to load:\n{location['message']}")
            if entry["loadStatus"] == "LOADED" and location.get("__typename") == "RepositoryLocation":
                dev.location_name = location["name"]
                dev.repository_name = location["repositories"][0]["name"]
                return True
        return None

    try:
        poll("dagster dev code location loaded", probe, timeout_s, interval_s=1.0)
    except TimeoutError as error:
        raise DagsterDevError(f"{error}\n{dev.log_tail()}") from error


def stop_dagster_dev(dev: DagsterDev, grace_s: float = 20.0) -> None:
    """End `dagster dev` and everything it started: SIGINT (its Ctrl-C path) to the main process,
    then SIGKILL for its process group and every descendant seen, whatever is left after `grace_s`."""
    dev.remember_descendants()
    if dev.process.poll() is None:
        try:
            dev.process.send_signal(signal.SIGINT)
            dev.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("dagster dev ignored SIGINT for %.0f s; killing its process group", grace_s)
        except ProcessLookupError:
            pass
    dev.remember_descendants()
    try:
        os.killpg(dev.process.pid, signal.SIGKILL)  # the group id is dagster dev's pid (new session)
    except (ProcessLookupError, PermissionError):
        pass
    for process in dev._descendants.values():
        try:
            process.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    try:
        dev.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        log.error("dagster dev (pid %s) still running after SIGKILL", dev.process.pid)


@contextmanager
def running_dagster_dev(tessera_home: Path, log_path: Path, ready_timeout_s: float) -> Iterator[DagsterDev]:
    """`dagster dev`, ready to use; always stopped on exit, also when start-up fails."""
    dev = start_dagster_dev(tessera_home, log_path)
    try:
        wait_until_ready(dev, ready_timeout_s)
        yield dev
    finally:
        stop_dagster_dev(dev)


# ---------------------------------------------------------------- GraphQL helpers

REPOSITORY_QUERY = """
query ($selector: RepositorySelector!) {
  repositoryOrError(repositorySelector: $selector) { __typename
    ... on Repository {
      jobs { name }
      schedules { name cronSchedule pipelineName }
      sensors { name }
    }
    ... on PythonError { message } } }
"""

ASSETS_QUERY = """
{ assetNodes { assetKey { path } groupName description jobNames isPartitioned
    assetChecksOrError { __typename ... on AssetChecks { checks { name description blocking } } } } }
"""

LAUNCH_RUN_MUTATION = """
mutation ($params: ExecutionParams!) {
  launchRun(executionParams: $params) { __typename
    ... on LaunchRunSuccess { run { runId status } }
    ... on PythonError { message stack }
    ... on RunConfigValidationInvalid { errors { message } }
    ... on InvalidSubsetError { message }
    ... on PipelineNotFoundError { message } } }
"""

RUN_STATUS_QUERY = """
query ($runId: ID!) { runOrError(runId: $runId) { __typename ... on Run { status } } }
"""

RUN_FAILURE_QUERY = """
query ($runId: ID!) { runOrError(runId: $runId) { ... on Run {
  eventConnection { events { __typename
    ... on ExecutionStepFailureEvent { stepKey error { message } }
    ... on RunFailureEvent { message error { message } }
    ... on EngineEvent { message error { message } } } } } } }
"""

LATEST_MATERIALIZATIONS_QUERY = """
{ assetNodes { assetKey { path } isPartitioned
    assetMaterializations(limit: 1) { runId partition }
    assetChecksOrError { ... on AssetChecks { checks { name
      executionForLatestMaterialization { runId status } } } } } }
"""


def repository_selector(dev: DagsterDev) -> dict:
    return {"repositoryLocationName": dev.location_name, "repositoryName": dev.repository_name}


def repository_contents(dev: DagsterDev) -> dict:
    data = dev.graphql(REPOSITORY_QUERY, {"selector": repository_selector(dev)})["repositoryOrError"]
    if data["__typename"] != "Repository":
        raise AssertionError(f"repository not loaded: {data}")
    return data


def asset_nodes(dev: DagsterDev) -> dict[str, dict]:
    """Asset nodes by their (single-part) key."""
    return {"/".join(node["assetKey"]["path"]): node for node in dev.graphql(ASSETS_QUERY)["assetNodes"]}


def latest_materializations(dev: DagsterDev) -> dict[str, dict]:
    """Each asset's latest materialization (run id, partition) and its checks' latest executions."""
    nodes = dev.graphql(LATEST_MATERIALIZATIONS_QUERY)["assetNodes"]
    return {"/".join(node["assetKey"]["path"]): node for node in nodes}


def launch_partition_run(dev: DagsterDev, job_name: str, partition_key: str) -> str:
    """Launch `job_name` for one partition, as the UI's "Materialize" does; return the run id."""
    params = {
        "selector": {**repository_selector(dev), "jobName": job_name},
        "runConfigData": {},  # the job's defaults, as a click on "Materialize" uses them
        "executionMetadata": {"tags": [{"key": "dagster/partition", "value": partition_key}]},
    }
    result = dev.graphql(LAUNCH_RUN_MUTATION, {"params": params})["launchRun"]
    if result["__typename"] != "LaunchRunSuccess":
        raise AssertionError(f"launchRun failed: {json.dumps(result)[:3000]}")
    return result["run"]["runId"]


def wait_for_run(dev: DagsterDev, run_id: str, timeout_s: float, on_poll: Callable[[], None] | None = None) -> str:
    """Poll the run's status until it is terminal; return it (SUCCESS, FAILURE or CANCELED)."""

    def probe() -> str | None:
        if on_poll:
            on_poll()
        if dev.process.poll() is not None:
            raise DagsterDevError(f"dagster dev exited during run {run_id}:\n{dev.log_tail()}")
        status = dev.graphql(RUN_STATUS_QUERY, {"runId": run_id})["runOrError"].get("status")
        return status if status in TERMINAL_RUN_STATUSES else None

    try:
        return poll(f"run {run_id} finished", probe, timeout_s, interval_s=3.0)
    except TimeoutError as error:
        raise TimeoutError(f"{error}; end of the dagster dev log:\n{dev.log_tail()}") from error


def run_failure_summary(dev: DagsterDev, run_id: str) -> str:
    """The error messages of a failed run, for the assertion message."""
    try:
        events = dev.graphql(RUN_FAILURE_QUERY, {"runId": run_id})["runOrError"]["eventConnection"]["events"]
    except Exception as error:  # diagnostics only: never hide the real failure
        return f"(could not read the run's events: {error})"
    lines = []
    for event in events:
        error = event.get("error") or {}
        if event["__typename"] == "ExecutionStepFailureEvent":
            lines.append(f"step {event['stepKey']}: {error.get('message', '').strip()}")
        elif event["__typename"] == "RunFailureEvent":
            lines.append(f"run: {event.get('message')} {error.get('message', '').strip()}")
        elif error:
            lines.append(f"engine: {event.get('message')}: {error.get('message', '').strip()}")
    return "\n".join(lines) or "(no failure events)"


# ---------------------------------------------------------------- Chromium


def ensure_chromium() -> Path:
    """Debian's Chromium, installed with apt-get when missing and we are root (CI runs as root on
    a fresh machine). Raises ChromiumUnavailable with the reason otherwise."""
    if CHROMIUM.exists():
        return CHROMIUM
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ChromiumUnavailable(f"{CHROMIUM} is missing and apt-get cannot install it (need root and apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Wait for the dpkg lock: a fresh machine's own package jobs may hold it for a while.
    apt_get = ["apt-get", "-o", "DPkg::Lock::Timeout=600"]
    install = [*apt_get, "install", "-y", "-q", "chromium"]  # with recommends: fonts for the screenshots
    attempts = [install, [*apt_get, "update", "-q"], install]  # a fresh machine may have no package lists
    output = ""
    for command in attempts:
        log.info("running %s", " ".join(command))
        try:
            result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
        except subprocess.TimeoutExpired as error:
            raise ChromiumUnavailable(f"{' '.join(command)} timed out") from error
        output = result.stdout[-2000:] + result.stderr[-2000:]
        if "install" in command and result.returncode == 0 and CHROMIUM.exists():
            return CHROMIUM
    raise ChromiumUnavailable(f"apt-get install chromium failed:\n{output}")


@contextmanager
def chromium_browser() -> Iterator[Any]:
    """A headless Chromium (Playwright `Browser`). ChromiumUnavailable if it cannot start."""
    try:
        from playwright.sync_api import Error as PlaywrightError
        from playwright.sync_api import sync_playwright
    except ImportError as error:  # a missing test dependency is a failure, not a skip
        raise ImportError("playwright is missing: pip install -e '.[test]'") from error
    executable = ensure_chromium()
    with sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(executable_path=str(executable), args=CHROMIUM_ARGS, timeout=60_000)
        except PlaywrightError as error:
            raise ChromiumUnavailable(f"{executable} does not start under Playwright: {error}") from error
        try:
            yield browser
        finally:
            browser.close()


def wait_for_stable_box(locator: Any, timeout_s: float = 15.0) -> None:
    """Wait until an element stops moving (the graph animates its zoom-to-fit)."""
    previous: list[dict | None] = [None]

    def probe() -> bool | None:
        box = locator.bounding_box()
        settled = box is not None and box == previous[0]
        previous[0] = box
        return True if settled else None

    poll("graph layout settled", probe, timeout_s, interval_s=0.3)


LAUNCH_BACKFILL_MUTATION = """
mutation($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) { __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message stack } ... on InvalidSubsetError { message } ... on UnauthorizedError { message } }
}"""
BACKFILL_STATUS_QUERY = """
query($id: String!) { partitionBackfillOrError(backfillId: $id) { __typename
  ... on PartitionBackfill { status } ... on PythonError { message } } }"""
PARTITION_MATERIALIZATIONS_QUERY = """
query($key: AssetKeyInput!, $partitions: [String!]) { assetOrError(assetKey: $key) { __typename
  ... on Asset { assetMaterializations(partitions: $partitions) { partition runId } } } }"""


def launch_asset_backfill(dev: DagsterDev, asset_keys: list[str], partition_keys: list[str]) -> str:
    """An asset backfill as the UI's "Materialize → backfill" launches it; the daemon runs it."""
    params = {"assetSelection": [{"path": [key]} for key in asset_keys], "partitionNames": partition_keys}
    result = dev.graphql(LAUNCH_BACKFILL_MUTATION, {"params": params})["launchPartitionBackfill"]
    if result["__typename"] != "LaunchBackfillSuccess":
        raise AssertionError(f"launchPartitionBackfill failed: {json.dumps(result)[:3000]}")
    return result["backfillId"]


def wait_for_backfill(dev: DagsterDev, backfill_id: str, timeout_s: float) -> str:
    def finished() -> str | None:
        status = dev.graphql(BACKFILL_STATUS_QUERY, {"id": backfill_id})["partitionBackfillOrError"].get("status")
        return status if status in {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"} else None

    return poll(f"backfill {backfill_id}", finished, timeout_s, interval_s=2.0)


def materialized_partitions(dev: DagsterDev, asset_key: str, partition_keys: list[str]) -> list[str]:
    """Partition of every materialization of the asset in these partitions (one entry per event)."""
    result = dev.graphql(PARTITION_MATERIALIZATIONS_QUERY, {"key": {"path": [asset_key]}, "partitions": partition_keys})
    return sorted(event["partition"] for event in result["assetOrError"]["assetMaterializations"])
