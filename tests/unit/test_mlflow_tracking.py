"""MLflow bookkeeping on a real SQLite tracking store: batched logging keeps every value."""

from __future__ import annotations

from pathlib import Path

from training_core.tracking import MlflowTracking


def test_log_batch_records_every_param_metric_point_and_tag_beyond_mlflow_request_limits(tmp_path: Path):
    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    run_id = tracking.start_run("batched", tags={})
    # more than MLflow's 100 params/tags and 1 000 metrics per request, so it must split them
    params = {f"param_{i:03d}": f"value-{i}" for i in range(150)}
    curve = [(step, 1.0 / step) for step in range(1, 2501)]
    tracking.log_batch(run_id, params=params, metrics={"steps": 2500.0, "restarts": 1.0},
                       series={"train_loss": curve}, tags={"model_dir": "/models/x"})
    tracking.log_metrics(run_id, {"eval_loss": 0.25})

    run = tracking.client.get_run(run_id)
    assert run.data.params == params
    assert run.data.metrics == {"steps": 2500.0, "restarts": 1.0, "train_loss": 1.0 / 2500, "eval_loss": 0.25}
    assert run.data.tags["model_dir"] == "/models/x"
    assert tracking.loss_history(run_id) == curve


def _published_model(tmp_path: Path) -> tuple[MlflowTracking, Path, dict[str, str]]:
    """A tracking store, a trained model folder with its recorded digest, and a complete reuse lineage."""
    from training_core.runs import REUSE_KEYS
    from training_core.storage import directory_digest

    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    model = tmp_path / "trained" / "train-all-x"
    model.mkdir(parents=True)
    (model / "adapter_model.safetensors").write_bytes(b"weights")
    directory_digest(model, record_files=True)
    return tracking, model, {key: f"{key}-value" for key in REUSE_KEYS}


def test_a_finished_run_is_reused_only_while_its_model_is_as_published(tmp_path: Path):
    from training_core.runs import find_reusable_run

    tracking, model, lineage = _published_model(tmp_path)
    run_id = tracking.start_run("train-all-x", tags={})
    tracking.log_batch(run_id, params=lineage, metrics={"steps": 1.0}, series={"train_loss": [(1, 2.0)]},
                       tags={"model_dir": str(model)})
    tracking.end_run(run_id)

    reused = find_reusable_run(tracking, lineage)
    assert reused is not None and reused.mlflow_run_id == run_id and reused.result.model_dir == str(model)
    assert find_reusable_run(tracking, {**lineage, "code_version": "other"}) is None
    # Other library versions (an in-range upgrade of transformers, numpy, ...): trained afresh.
    assert find_reusable_run(tracking, {**lineage, "environment_digest": "other"}) is None

    (model / "adapter_model.safetensors").write_bytes(b"")  # emptied by hand, or a killed copy
    assert find_reusable_run(tracking, lineage) is None


def test_library_versions_decide_reuse_and_the_ray_run_name(monkeypatch):
    import training_core.lineage as lineage_module
    from training_core.runs import REUSE_KEYS, TrainingInputs, ray_run_name

    def record() -> dict[str, str]:
        return lineage_module.build_lineage_record(
            seed=0, data_seed=0, dataset_digest="d" * 64, dataset_paths=["/data/day"], cache_version="c",
            base_model="/models/base", base_model_digest="b" * 64, config_digest="f" * 64, dagster_run_id="r",
            partition_keys=["2026-11-01"])

    installed = record()
    assert "environment_digest" in REUSE_KEYS and "version_numpy" in installed  # numpy draws the data order
    assert installed["environment_digest"] == lineage_module.environment_digest(  # dagster, mlflow: recorded only
        {key: value for key, value in installed.items()
         if key.startswith("version_") and key not in ("version_dagster", "version_mlflow")})
    assert record()["environment_digest"] == installed["environment_digest"]  # deterministic

    upgraded_versions = {**lineage_module.package_versions(), "version_transformers": "5.99.0"}
    monkeypatch.setattr(lineage_module, "package_versions", lambda: upgraded_versions)
    upgraded = record()
    assert upgraded["environment_digest"] != installed["environment_digest"]
    inputs = TrainingInputs(base_model="/models/base", base_model_digest="b" * 64, dataset_paths=["/data/day"],
                            dataset_digest="d" * 64, seq_len=64, cache_directory=None, cache_version="c",
                            partition_keys=["2026-11-01"])
    assert ray_run_name(inputs, upgraded) != ray_run_name(inputs, installed)  # never resumes the old checkpoints


def log_adapter_files(tracking: MlflowTracking, run_id: str, folder: Path) -> None:
    """The files a PEFT adapter's ``model`` artifact holds (contents do not matter to the registry)."""
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "adapter_config.json").write_text("{}")
    (folder / "model" / "adapter_model.safetensors").write_bytes(b"weights")
    tracking.client.log_artifacts(run_id, str(folder / "model"), "model")


def test_a_promotion_killed_before_the_alias_moved_is_finished_without_a_second_version(tmp_path: Path):
    from training_core.registry import ModelRegistry

    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    registry = ModelRegistry(tracking, "adapter", "champion")
    first, second = (tracking.start_run(name, tags={}) for name in ("first", "second"))
    for run_id in (first, second):
        log_adapter_files(tracking, run_id, tmp_path / run_id)
    assert registry.promote(first) == ("1", True)
    # killed between create_model_version and set_registered_model_alias:
    source = f"{tracking.client.get_run(second).info.artifact_uri}/model"
    tracking.client.create_model_version("adapter", source, run_id=second)
    assert registry.promote(second) == ("2", True)
    assert registry.champion().run_id == second
    assert len(tracking.client.search_model_versions("name = 'adapter'")) == 2
    assert registry.promote(second) == ("2", False)


def test_runs_left_running_by_a_killed_process_are_marked_killed(tmp_path: Path):
    import subprocess
    import sys

    from training_core.tracking import PROCESS_TAG

    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    ours = tracking.start_run("ours", tags={})
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = tracking.client.get_run(ours).data.tags[PROCESS_TAG].rsplit(":", 2)[0]
    killed = tracking.start_run("killed", tags={PROCESS_TAG: f"{host}:{exited.stdout.strip()}:1.000"})
    untagged = tracking.start_run("untagged", tags={PROCESS_TAG: ""})

    assert tracking.end_abandoned_runs() == [killed]
    status = {run_id: tracking.client.get_run(run_id).info.status for run_id in (ours, killed, untagged)}
    assert status == {ours: "RUNNING", killed: "KILLED", untagged: "RUNNING"}


def test_a_champion_whose_artifacts_are_gone_is_named_by_version_and_run(tmp_path: Path):
    import shutil

    import pytest

    from training_core.errors import LineageError
    from training_core.registry import ModelRegistry

    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    registry = ModelRegistry(tracking, "adapter", "champion")
    run_id = tracking.start_run("champion", tags={})
    tracking.log_batch(run_id, params={"base_model": "/models/base"})
    log_adapter_files(tracking, run_id, tmp_path / "upload")
    registry.promote(run_id)
    local = registry.download(registry.champion(), tmp_path / "first")
    assert registry.base_model_of(registry.champion()) == "/models/base"
    assert Path(local, "adapter_model.safetensors").read_bytes() == b"weights"

    shutil.rmtree(tmp_path / "artifacts")  # the artifact store lost the run's files
    with pytest.raises(LineageError, match=rf"adapter version 1 \(MLflow run {run_id}\), alias 'champion': its model "
                                           r"artifacts cannot be downloaded \("):
        registry.download(registry.champion(), tmp_path / "second")


def test_a_champion_whose_run_is_gone_or_recorded_no_base_model_is_named_by_version_and_run(tmp_path: Path):
    import pytest
    from mlflow.exceptions import MlflowException

    from tests.unit.conftest import garbage_collect_run
    from training_core.errors import LineageError
    from training_core.registry import ModelRegistry

    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    registry = ModelRegistry(tracking, "adapter", "champion")
    unrecorded, recorded = (tracking.start_run(name, tags={}) for name in ("unrecorded", "recorded"))
    tracking.log_batch(recorded, params={"base_model": "/models/base"})
    for run_id in (unrecorded, recorded):
        log_adapter_files(tracking, run_id, tmp_path / run_id)

    registry.promote(unrecorded)  # a run from before the lineage record
    with pytest.raises(LineageError, match=rf"^adapter version 1 \(MLflow run {unrecorded}\), alias 'champion': "
                                           r"its run records no 'base_model' param"):
        registry.base_model_of(registry.champion())

    registry.promote(recorded)
    tracking.client.delete_run(recorded)  # deleted only: MLflow still serves it until `mlflow gc`
    assert registry.base_model_of(registry.champion()) == "/models/base"
    garbage_collect_run(tracking.tracking_uri, recorded)
    with pytest.raises(LineageError, match=rf"^adapter version 2 \(MLflow run {recorded}\), alias 'champion': "
                                           r"its run is not in the tracking store \(deleted and garbage-collected") as gone:
        registry.base_model_of(registry.champion())
    assert isinstance(gone.value.__cause__, MlflowException)


def test_a_tracking_server_that_does_not_answer_is_not_taken_for_a_champion_whose_run_is_gone(monkeypatch):
    import socket
    from types import SimpleNamespace

    import pytest
    from mlflow.entities.model_registry import ModelVersion
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from training_core.registry import ModelRegistry

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    registry = ModelRegistry(SimpleNamespace(client=MlflowClient(f"http://127.0.0.1:{port}")), "adapter", "champion")
    # Treated as "gone", an outage would let any model replace the champion without a comparison.
    with pytest.raises(MlflowException) as raised:
        registry.base_model_of(ModelVersion("adapter", "1", 0, run_id="0" * 32))
    assert raised.value.error_code != "RESOURCE_DOES_NOT_EXIST"


def test_registered_versions_say_whether_they_hold_an_adapter_or_a_full_model(tmp_path: Path):
    from training_core.registry import ModelRegistry

    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    registry = ModelRegistry(tracking, "models", "champion")
    runs = {}
    for kind, files in (("lora", ["adapter_config.json", "adapter_model.safetensors"]),
                        ("full", ["config.json", "model.safetensors"])):
        runs[kind] = tracking.start_run(kind, tags={})
        tracking.log_batch(runs[kind], params={"base_model": f"/models/base-{kind}"})
        folder = tmp_path / kind / "model"
        folder.mkdir(parents=True)
        for name in files:
            (folder / name).write_text("{}")
        tracking.client.log_artifacts(runs[kind], str(folder), "model")
        registry.promote(runs[kind])

    versions = {v.run_id: v for v in tracking.client.search_model_versions("name = 'models'")}
    adapter, full = versions[runs["lora"]], versions[runs["full"]]
    assert adapter.tags == {"tessera.model_kind": "peft-adapter", "tessera.base_model": "/models/base-lora"}
    assert full.tags == {"tessera.model_kind": "full-model", "tessera.base_model": "/models/base-full"}
    assert adapter.description.startswith("PEFT adapter on base model /models/base-lora: PeftModel.from_pretrained(")
    assert full.description.startswith("full model fine-tuned from /models/base-full: AutoModelForCausalLM")


def test_a_version_trained_on_a_hub_model_names_its_repo_and_commit_not_this_machines_cache(tmp_path: Path):
    from training_core.registry import ModelRegistry

    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    commit = "a" * 40
    run = tracking.start_run("hub", tags={})
    tracking.log_batch(run, params={"base_model": f"/cache/hub/models--org--tiny/snapshots/{commit}",
                                    "base_model_digest": f"hub:org/tiny@{commit}"})
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    tracking.client.log_artifacts(run, str(folder), "model")
    ModelRegistry(tracking, "models", "champion").promote(run)
    (version,) = tracking.client.search_model_versions("name = 'models'")
    assert version.tags["tessera.base_model"] == f"org/tiny@{commit}"
    assert version.description == (
        f"PEFT adapter on base model org/tiny@{commit}: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("
        f"'org/tiny', revision='{commit}'), <this version's folder>)")


def test_a_finished_run_is_reused_after_more_reproductions_of_it_than_one_search_page(tmp_path: Path):
    from training_core.runs import find_reusable_run

    tracking, model, lineage = _published_model(tmp_path)
    original = tracking.start_run("train-all-x", tags={})
    tracking.log_batch(original, params=lineage, tags={"model_dir": str(model)})
    tracking.end_run(original)
    for number in range(60):  # each `tessera reproduce` records a run with the same lineage, newer
        reproduction = tracking.start_run(f"train-all-x-reproduce-{number}", tags={"reproduces": original})
        tracking.log_batch(reproduction, params=lineage, tags={"model_dir": str(model)})
        tracking.end_run(reproduction)

    reused = find_reusable_run(tracking, lineage)
    assert reused is not None and reused.mlflow_run_id == original


def test_a_deleted_experiment_is_refused_naming_the_restore_command(tmp_path: Path):
    import pytest

    from training_core.errors import ConfigError

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking = MlflowTracking(uri, tmp_path / "artifacts")
    tracking.client.delete_experiment(tracking.experiment_id)
    with pytest.raises(ConfigError, match=rf"MLflow experiment 'tessera' \(id {tracking.experiment_id}\) at {uri} is "
                                          rf"deleted: restore it with `MLFLOW_TRACKING_URI={uri} mlflow experiments "
                                          rf"restore --experiment-id {tracking.experiment_id}`"):
        MlflowTracking(uri, tmp_path / "artifacts")
    tracking.client.restore_experiment(tracking.experiment_id)
    assert MlflowTracking(uri, tmp_path / "artifacts").experiment_id == tracking.experiment_id


def test_a_runs_throughput_metrics_carry_what_they_count(tmp_path: Path):
    # tokens_per_s and mfu changed definition on 2026-12-06 under the same names: the tag tells a
    # dashboard which definition a run's figures follow (runs without it counted padding).
    from training_core.train.result import TrainingResult
    from training_core.train.telemetry import THROUGHPUT_COUNTING

    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    model = tmp_path / "model"
    model.mkdir()
    (model / "adapter_model.safetensors").write_bytes(b"weights")
    run_id = tracking.start_run("train", tags={})
    result = TrainingResult(run_name="train", model_dir=str(model), steps=2, restarts=0,
                            loss_history=[(1, 2.0), (2, 1.5)], telemetry={"tokens_per_s": 10.0, "mfu": 0.25},
                            deepspeed_config={})
    tracking.log_training(run_id, result=result)
    run = tracking.client.get_run(run_id)
    assert run.data.tags["tessera.throughput_counting"] == THROUGHPUT_COUNTING == (
        "example tokens, attention within each example")
    assert run.data.metrics["tokens_per_s"] == 10.0 and run.data.metrics["mfu"] == 0.25
