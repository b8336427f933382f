"""Settings that looked right and silently did something else are refused, naming the setting: promotion
gates typed as percentages, evaluation this machine cannot run (refused at launch, not after training),
and an MLflow store that is not one place for every process."""

from __future__ import annotations

import re

import pytest
import torch

from assets.launch_checks import run_config_problems
from pipelines.definitions import defs
from resources import MlflowTracker, TesseraStorage
from training_core.errors import ConfigError


def _evaluation_problems(**config) -> list[str]:
    return run_config_problems(defs.resolve_job_def("train_and_promote"), {"ops": {"evaluation": {"config": config}}})


# --- promotion gates ------------------------------------------------------------------------------


@pytest.mark.parametrize(("config", "problem"), [
    # "5 %" typed as 5 let a model 5× worse than the champion through.
    ({"champion_tolerance": 5}, "ops.evaluation.config.champion_tolerance: is a fraction below 1 (0.05 means 5 %"),
    ({"champion_tolerance": 1.0}, "ops.evaluation.config.champion_tolerance: is a fraction below 1"),
    # 5 let a model 3× worse than the base through.
    ({"max_loss_ratio": 5}, "ops.evaluation.config.max_loss_ratio: is a ratio of held-out losses, trained / base "
                            "(1.0: below the base's loss"),
])
def test_gates_typed_as_percentages_are_refused_at_launch_naming_the_field(config, problem):
    (found,) = _evaluation_problems(**config)
    assert found.startswith(problem)
    assert f"got {float(next(iter(config.values())))!r}" in found


def test_the_loosest_gates_that_are_still_gates_are_accepted():
    assert _evaluation_problems(champion_tolerance=0.99, max_loss_ratio=2.0) == []


# --- evaluation settings this machine cannot run --------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: bf16 and cuda evaluation can run")
@pytest.mark.parametrize(("config", "problem"), [
    ({"precision": "bf16"}, "evaluation precision='bf16' needs a GPU, and the process that evaluates sees no CUDA GPU"),
    ({"device": "cuda"}, "evaluation device='cuda' but the process that evaluates sees no CUDA GPU"),
])
def test_evaluation_in_the_steps_process_that_needs_a_gpu_is_refused_at_launch_on_a_machine_without_one(
        config, problem):
    (found,) = _evaluation_problems(**config)
    assert found.startswith(f"ops.evaluation.config: {problem}")
    assert "on_ray_cluster: true" in found  # the way to evaluate on GPUs this machine lacks
    # On the Ray cluster the evaluation task may get a GPU: not this machine's to decide.
    assert _evaluation_problems(**config, on_ray_cluster=True) == []


# --- MLflow store -------------------------------------------------------------------------------


def test_a_relative_sqlite_tracking_uri_is_refused_showing_the_absolute_form(tmp_path, monkeypatch):
    # Each step process opened mlflow.db in its own working directory: "Run with id=… not found".
    working_directory = tmp_path / "cwd"
    working_directory.mkdir()
    monkeypatch.chdir(working_directory)
    home = tmp_path / "home"
    tracker = MlflowTracker(storage=TesseraStorage(home=str(home)), tracking_uri="sqlite:///mlflow.db")
    with pytest.raises(ConfigError, match=re.escape("mlflow_tracker.tracking_uri 'sqlite:///mlflow.db': the database "
                                                    "path 'mlflow.db' is relative") +
                       r".*" + re.escape(f"sqlite:///{working_directory / 'mlflow.db'}")):
        tracker.client()
    assert not list(working_directory.iterdir()) and not home.exists()  # refused before anything was created


@pytest.mark.parametrize("uri", ["sqlite:///:memory:", "sqlite:///file:runs?mode=memory&uri=true"])
def test_an_in_memory_sqlite_tracking_uri_is_refused(tmp_path, uri):
    tracker = MlflowTracker(storage=TesseraStorage(home=str(tmp_path)), tracking_uri=uri)
    with pytest.raises(ConfigError, match=r"^mlflow_tracker.tracking_uri .*: names no database file, so SQLite "
                                          r"would keep every run in memory"):
        tracker.client()


@pytest.mark.parametrize("experiment", ["", "  "])
def test_an_empty_experiment_name_is_refused_naming_the_setting(tmp_path, experiment):
    tracker = MlflowTracker(storage=TesseraStorage(home=str(tmp_path)), experiment=experiment)
    with pytest.raises(ConfigError, match=re.escape(f"mlflow_tracker.experiment {experiment!r}: expected the name")):
        tracker.client()
    assert not (tmp_path / "mlflow.db").exists()
