"""The demo on an external two-node Ray cluster (`ray start --head` + `ray start --address`), killed
mid-training and relaunched: the second Dagster run resumes from the last checkpoint."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.ports import free_port
from training_core.train.ray_trainer import LOCAL_RAY_SETTINGS_ENV

pytestmark = pytest.mark.integration

VENV_BIN = Path(sys.executable).parent
DEADLINE_S = 600


def _ray(*args: str, env: dict) -> None:
    subprocess.run([str(VENV_BIN / "ray"), *args], check=True, env=env, capture_output=True, timeout=120)


# Ray 2.60 enables token authentication on `ray start --head`; every node and driver then needs
# the token, which `ray start` keeps in the user's home on this machine.
CLUSTER_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "DS_ACCELERATOR": "cpu", "RAY_AUTH_MODE": "token"}


def _stop_cluster(temp_dir: Path) -> None:
    """Kill only this cluster's processes (`ray stop` would also stop the test session's Ray)."""
    import psutil

    ours = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if any(str(temp_dir) in part for part in process.info["cmdline"] or []):
                ours.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for process in ours:
        for child in [*process.children(recursive=True), process]:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
    psutil.wait_procs(ours, timeout=30)


@pytest.fixture(scope="module")
def two_node_cluster():
    port = free_port()
    env = {**os.environ, **CLUSTER_ENV}
    # Short and directly under /tmp: Ray's AF_UNIX socket paths live below it, and a socket path
    # over 107 bytes fails (pytest's per-worker base temp, ".../popen-gw1/...", is too deep).
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    try:
        _ray("start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
             f"--temp-dir={temp_dir}", "--disable-usage-stats", env=env)
        _ray("start", f"--address=127.0.0.1:{port}", "--num-cpus=1", f"--temp-dir={temp_dir}", env=env)
        yield f"127.0.0.1:{port}"
    finally:
        _stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _start_demo(home: Path, address: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, **CLUSTER_ENV, "TESSERA_RAY_ADDRESS": address, "PYTHONUNBUFFERED": "1"}
    env.pop("TESSERA_FAULT_STEP", None)
    # Ray Train's own actors as an external cluster runs them: the test session's local-Ray
    # settings (no preemption watcher, no cluster-service actors, pooled worker processes) must not
    # leak into this run.
    for name in LOCAL_RAY_SETTINGS_ENV:
        env.pop(name, None)
    return subprocess.Popen([str(VENV_BIN / "tessera"), "demo", "--home", str(home)], env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait(predicate, what: str, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if predicate():
            return
        if process is not None and process.poll() is not None:
            raise AssertionError(f"process exited with {process.returncode} before {what}")
        time.sleep(0.5)  # polling a file system condition, bounded by the deadline
    raise AssertionError(f"timed out waiting for {what}")


# Connects without the cluster's token; exits with RayClusterUnreachable's message (after printing the
# error it was raised from), or a traceback.
CONNECT_WITHOUT_TOKEN = """
import sys
import dagster as dg
from resources.ray_cluster import ExternalRayCluster, RayClusterUnreachable, connect_to_cluster
try:
    connect_to_cluster(ExternalRayCluster(address=sys.argv[1]), dg.build_init_resource_context())
except RayClusterUnreachable as error:
    print("raised from", type(error.__cause__).__name__)
    sys.exit(str(error))
"""


def test_a_driver_without_the_clusters_token_is_told_to_set_it(two_node_cluster):
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    # No auth settings (Ray then sends no token, even with ~/.ray/auth_token present), and nothing that
    # could point ray.init at the test session's own Ray instead of the address given.
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", *LOCAL_RAY_SETTINGS_ENV):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-c", CONNECT_WITHOUT_TOKEN, two_node_cluster], env=env,
                            cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0, result.stdout[-2000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"Ray cluster at {two_node_cluster} "), result.stderr[-3000:]
    assert "uses token authentication" in last_line
    assert "Set RAY_AUTH_MODE=token" in last_line and "RAY_AUTH_TOKEN" in last_line
    # Told by the GCS's first answer, not after ray.init's ~20 s of retries (its ConnectionError).
    assert "raised from AuthenticationError" in result.stdout, result.stdout[-2000:]


def test_demo_on_external_cluster_survives_a_killed_dagster_run(two_node_cluster, tmp_path):
    home = tmp_path / "home"
    first = _start_demo(home, two_node_cluster, tmp_path / "first.log")
    try:
        _wait(lambda: any((home / "ray").glob("*/checkpoint_*/progress.json")), "a first checkpoint", first)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the whole Dagster run, mid-training
        first.wait(timeout=60)
    second = _start_demo(home, two_node_cluster, tmp_path / "second.log")
    assert second.wait(timeout=DEADLINE_S) == 0, (tmp_path / "second.log").read_text()[-3000:]

    output = (tmp_path / "second.log").read_text()
    assert "resumed from checkpoint" in output
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("tessera").experiment_id],
                              filter_string="attributes.status = 'FINISHED'")
    (finished,) = runs
    assert finished.data.metrics["restarts"] >= 1
    # Two one-CPU Ray nodes share this host: each has local rank 0, so ranks must not be pinned.
    assert finished.data.metrics["cpu_cores_visible"] == len(os.sched_getaffinity(0))
    assert finished.data.metrics["eval_exact_match"] >= 0.5
    history = client.get_metric_history(finished.info.run_id, "train_loss")
    assert [m.step for m in sorted(history, key=lambda m: m.step)] == list(range(1, int(finished.data.metrics["steps"]) + 1))
