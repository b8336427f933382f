"""`tessera reproduce` in a pod of the Kubernetes deployment: it reads the deployment's settings as its
code location does (TESSERA_RAY_STORAGE, TESSERA_RAY_ADDRESS), logs into the recorded run's MLflow
experiment, and refuses a GPU run on a Ray without GPUs saying how to reach the GPU cluster.

Runs are recorded in the state folder's real SQLite MLflow store and read back by the real
`load_recorded_run`; Ray is not started (where reproduce connects and trains is recorded instead)."""

from __future__ import annotations

import json
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from pipelines import reproduce
from tests.unit.deploy_support import RAY_MANIFEST
from tests.unit.test_reproduce_inputs import _published_dataset, _record_run
from training_core.process_identity import this_process
from training_core.tracking import MlflowTracking
from training_core.train.config import TrainingConfig

REPO = Path(__file__).resolve().parents[2]
# Prints this_process() of a `tessera reproduce` stand-in, then runs until its stdin is closed.
REPRODUCE_PROCESS = ("import sys; from training_core.process_identity import this_process; "
                     "print(this_process(), flush=True); sys.stdin.read()")


class _Trained(Exception):
    """Stops the reproduction where it would train: what it would train with is recorded."""


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("TESSERA_HOME", str(home))
    for name in ("TESSERA_RAY_ADDRESS", "TESSERA_RAY_STORAGE"):
        monkeypatch.delenv(name, raising=False)
    return home


def _recorded_run(home: Path, experiment: str = "tessera", config: TrainingConfig | None = None) -> tuple[str, str]:
    """(run id, experiment id) of a finished run in the state folder's MLflow store."""
    tracking = MlflowTracking(f"sqlite:///{home / 'mlflow.db'}", home / "mlartifacts", experiment)
    config = config or TrainingConfig()
    run_id = _record_run(tracking, home, [_published_dataset(home / "datasets" / "2026-11-01")],
                         config_text=json.dumps(config.model_dump(mode="json")),
                         overrides={"config_digest": config.digest()})
    return run_id, tracking.experiment_id


def _reproduce_until_training(monkeypatch, run_id: str) -> dict:
    trained_with = {}

    def record(config, inputs, tracking, **kwargs):
        trained_with.update(experiment_id=tracking.experiment_id, ray_storage=kwargs["ray_storage"])
        raise _Trained

    monkeypatch.setattr(reproduce, "_connect_to_ray", lambda ray_cluster: None)
    monkeypatch.setattr(reproduce, "gpu_available_in_cluster", lambda: False)
    monkeypatch.setattr("resources.ray_cluster.alive_node_resources", lambda: [{"CPU": 64.0}])
    monkeypatch.setattr(reproduce, "run_tracked_training", record)
    with pytest.raises(_Trained):
        reproduce.reproduce_run(run_id, Console(file=StringIO()))
    return trained_with


def test_reproduce_checkpoints_to_the_deployments_ray_storage(home, tmp_path, monkeypatch):
    run_id, _ = _recorded_run(home)
    assert _reproduce_until_training(monkeypatch, run_id)["ray_storage"] == str(home / "ray")
    monkeypatch.setenv("TESSERA_RAY_STORAGE", str(tmp_path / "shared" / "ray"))  # ConfigMap tessera-config
    assert _reproduce_until_training(monkeypatch, run_id)["ray_storage"] == str(tmp_path / "shared" / "ray")


def test_reproduce_logs_the_reproduction_into_the_recorded_runs_experiment(home, monkeypatch):
    # A run config that named another mlflow_tracker.experiment recorded the run there.
    run_id, experiment_id = _recorded_run(home, experiment="llm-platform")
    assert _reproduce_until_training(monkeypatch, run_id)["experiment_id"] == experiment_id


@pytest.mark.parametrize(("address", "where"), [(None, "in-process Ray on this machine"),
                                                ("10.0.0.5:6379", "TESSERA_RAY_ADDRESS=10.0.0.5:6379")],
                         ids=["in-process ray", "external cluster"])
def test_a_gpu_run_on_a_ray_without_gpus_is_refused_saying_how_to_train_on_the_gpu_cluster(
        home, monkeypatch, address, where):
    if address:
        monkeypatch.setenv("TESSERA_RAY_ADDRESS", address)
    run_id, _ = _recorded_run(home, config=TrainingConfig(use_gpu=True))
    connected = []
    monkeypatch.setattr(reproduce, "connect_unless_connected", lambda cluster, context: connected.append(cluster))
    monkeypatch.setattr(reproduce, "gpu_available_in_cluster", lambda: False)
    output = StringIO()

    assert reproduce.reproduce_run(run_id, Console(file=output, soft_wrap=True)) == 2
    # connected as the code location's ray_cluster resource connects
    assert [cluster.ray_address for cluster in connected] == [address or "local"]
    assert (f"cannot reproduce: run {run_id}: use_gpu=True but no CUDA GPU is visible in the Ray cluster it would "
            f"train on ({where}). To reproduce it on GPUs, set TESSERA_RAY_ADDRESS to the head of a cluster with GPU "
            "nodes") in output.getvalue()
    # the address KubeRay gives the head service of deploy/kuberay/raycluster.yaml: renaming the cluster
    # or its namespace there must update the address this refusal names
    meta = RAY_MANIFEST["metadata"]
    head_service = f"ray://{meta['name']}-head-svc.{meta['namespace']}.svc.cluster.local:10001"
    assert f"in a pod of the Kubernetes deployment, TESSERA_RAY_ADDRESS={head_service}" in output.getvalue()


@pytest.mark.parametrize("interruption", [RuntimeError("worker failed at step 60"), KeyboardInterrupt()],
                         ids=["failed", "ctrl-c"])
def test_a_reproduction_that_stops_early_leaves_no_checkpoints_behind(home, monkeypatch, interruption):
    """Nothing resumes a reproduction (its run name ends in a fresh id), so checkpoints left by a
    failed or interrupted one, engine state included, would fill the disk for ever."""
    run_id, _ = _recorded_run(home)

    def train_then_stop(config, inputs, tracking, *, ray_storage, run_name_suffix, **kwargs):
        checkpoint = Path(ray_storage) / f"train-2026-11-01-abc-{run_name_suffix}" / "checkpoint_000001"
        (checkpoint / "deepspeed").mkdir(parents=True)
        (checkpoint / "deepspeed" / "optim_states.pt").write_bytes(b"x" * 64)
        raise interruption

    other_run = home / "ray" / "train-2026-11-01-abc-def"  # a training run's folder: resumable, kept
    other_run.mkdir(parents=True)
    monkeypatch.setattr(reproduce, "_connect_to_ray", lambda ray_cluster: None)
    monkeypatch.setattr(reproduce, "gpu_available_in_cluster", lambda: False)
    monkeypatch.setattr("resources.ray_cluster.alive_node_resources", lambda: [{"CPU": 64.0}])
    monkeypatch.setattr(reproduce, "run_tracked_training", train_then_stop)
    with pytest.raises(type(interruption)):
        reproduce.reproduce_run(run_id, Console(file=StringIO()))
    assert sorted(p.name for p in (home / "ray").iterdir()) == [other_run.name]


def _checkpoints_of_reproduction(ray_storage: Path, suffix: str, process: str) -> Path:
    """What `tessera reproduce` leaves while it trains: its run folder and the file naming its process."""
    folder = ray_storage / f"train-2026-11-01-abc-{suffix}"
    (folder / "checkpoint_000001" / "deepspeed").mkdir(parents=True)
    (folder / "checkpoint_000001" / "deepspeed" / "optim_states.pt").write_bytes(b"x" * 64)
    (ray_storage / f".{suffix}.process").write_text(process)
    return folder


def test_a_reproduction_killed_with_kill_9_has_its_checkpoints_removed_by_the_next(home, monkeypatch):
    """kill -9 skips reproduce's own cleanup: the next reproduce removes that folder (engine and optimizer
    state, several times the model for a full fine-tune), but never one of a reproduction still running
    in another process, nor a training run's folder."""
    run_id, _ = _recorded_run(home)
    ray_storage = home / "ray"
    exited = subprocess.run([sys.executable, "-c", REPRODUCE_PROCESS], cwd=REPO, input="", capture_output=True,
                            text=True, check=True).stdout.strip()
    killed = _checkpoints_of_reproduction(ray_storage, "reproduce-0badc0de", exited)
    running = subprocess.Popen([sys.executable, "-c", REPRODUCE_PROCESS], cwd=REPO, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        running_identity = running.stdout.readline().strip()
        still_running = _checkpoints_of_reproduction(ray_storage, "reproduce-5eed1e55", running_identity)
        training_run = ray_storage / "train-2026-11-01-abc-def"  # resumable: no process file, kept
        training_run.mkdir()
        present_while_training = []

        def train(config, inputs, tracking, *, ray_storage, run_name_suffix, **kwargs):
            present_while_training.extend(sorted(p.name for p in Path(ray_storage).iterdir()))
            assert (Path(ray_storage) / f".{run_name_suffix}.process").read_text() == this_process()
            raise _Trained

        monkeypatch.setattr(reproduce, "_connect_to_ray", lambda ray_cluster: None)
        monkeypatch.setattr(reproduce, "gpu_available_in_cluster", lambda: False)
        monkeypatch.setattr("resources.ray_cluster.alive_node_resources", lambda: [{"CPU": 64.0}])
        monkeypatch.setattr(reproduce, "run_tracked_training", train)
        output = StringIO()
        with pytest.raises(_Trained):
            reproduce.reproduce_run(run_id, Console(file=output, soft_wrap=True))
        assert not killed.exists() and killed.name not in present_while_training
        assert f"removed {killed}: the checkpoints of a reproduction whose process is gone" in output.getvalue()
        assert (still_running / "checkpoint_000001" / "deepspeed" / "optim_states.pt").is_file()
        assert sorted(p.name for p in ray_storage.iterdir()) == [
            ".reproduce-5eed1e55.process", training_run.name, still_running.name]
    finally:
        running.communicate(input="")


def test_metrics_that_differ_are_shown_with_every_digit():
    # eval_loss changed by 3.6e-10 after the eval-loss rewrite: at 6 digits both read 0.00555272, marked NO.
    rows = [("train_loss curve", "step 7: 1.25", "step 7: 1.2500000001", False), ("train_loss", 1.2345678, 1.2345678, True),
            ("eval_loss", 0.005552722056906427, 0.005552721697481434, False), ("steps", 60.0, 59.0, False),
            ("eval_exact_match", None, 1.0, None)]
    output = StringIO()
    Console(file=output, width=200).print(reproduce.comparison_table("a", "b", rows))
    lines = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:5]]
             for line in output.getvalue().splitlines() if line.count("│") == 5}
    assert lines["eval_loss"] == ["0.005552722056906427", "0.005552721697481434", "NO"]
    assert lines["steps"] == ["60", "59", "NO"]
    assert lines["train_loss"] == ["1.23457", "1.23457", "yes"]
    assert lines["train_loss curve"] == ["step 7: 1.25", "step 7: 1.2500000001", "NO"]
    assert lines["eval_exact_match"] == ["—", "1", "not recorded"]


def test_a_loss_curve_shows_its_first_differing_step_or_each_runs_length():
    from training_core.reproduce import _curve_cells

    original = [(1, 2.0), (2, 1.5), (3, 1.25)]
    assert _curve_cells(original, [(1, 2.0), (2, 1.5000001), (3, 1.25)]) == ("step 2: 1.5", "step 2: 1.5000001")
    assert _curve_cells(original, original[:2]) == ("3 steps", "2 steps")  # a reproduction that stopped early
    assert _curve_cells(original[:2], original) == ("2 steps", "3 steps")
