"""The whole asset graph with real Dagster, Ray, DeepSpeed, PEFT and MLflow, on demo defaults."""

from __future__ import annotations

import json
import os
from pathlib import Path

import dagster as dg
import pytest
from mlflow.tracking import MlflowClient

from assets.evaluation_assets import CHAMPION_ALIAS, REGISTERED_MODEL
from assets.partitions import DEMO_PARTITION
from pipelines.graph import ASSETS
from pipelines.resources_local import local_resources

pytestmark = pytest.mark.e2e

LINEAGE_KEYS = {
    "seed", "data_seed", "dataset_digest", "cache_version", "base_model", "base_model_digest", "config_digest",
    "code_version", "dagster_run_id", "partition_keys", "version_torch", "version_deepspeed",
    "version_transformers", "version_peft", "version_ray", "version_pyarrow", "version_numpy", "environment_digest",
}


# An MLflow run a killed Kubernetes step pod left RUNNING (another host's process), whose Dagster run failed.
POD_KILLED_DAGSTER_RUN = "pod-killed-dagster-run"


@pytest.fixture(scope="module")
def demo_run(ray_session, tmp_path_factory):
    home = tmp_path_factory.mktemp("tessera-home")
    _leave_a_pod_killed_run(home)
    return home, _materialize(home)


def _leave_a_pod_killed_run(home: Path) -> str:
    from dagster._core.storage.dagster_run import DagsterRun

    from training_core.tracking import PROCESS_TAG, MlflowTracking

    (home / "dagster").mkdir(parents=True)
    instance = dg.DagsterInstance.local_temp(str(home / "dagster"))
    instance.add_run(DagsterRun(job_name="train_and_promote", run_id=POD_KILLED_DAGSTER_RUN,
                                status=dg.DagsterRunStatus.FAILURE))
    tracking = MlflowTracking(f"sqlite:///{home / 'mlflow.db'}", home / "mlartifacts")
    run_id = tracking.client.create_run(tracking.experiment_id, run_name="pod-killed",
                                        tags={PROCESS_TAG: "tessera-run-abc-lora-adapter-xyz:7:123@bootid"}).info.run_id
    tracking.log_batch(run_id, params={"dagster_run_id": POD_KILLED_DAGSTER_RUN})  # as its lineage logged it
    return run_id


def _materialize(home: Path, run_config: dict | None = None, partition_key: str = DEMO_PARTITION,
                 selection: list[str] | None = None):
    """One persistent Dagster instance per home, so later runs load earlier outputs (like the UI)."""
    (home / "dagster").mkdir(parents=True, exist_ok=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("TESSERA_HOME", str(home))
    try:
        return dg.materialize(ASSETS, partition_key=partition_key, resources=local_resources(),
                              instance=dg.DagsterInstance.local_temp(str(home / "dagster")), run_config=run_config,
                              selection=selection, raise_on_error=False)
    finally:
        mp.undo()


def _failure_message(result) -> str:
    return next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE").step_failure_data.error.message


def _materialization(result, key: str):
    return next(e.materialization for e in result.get_asset_materialization_events() if e.asset_key.path[-1] == key)


def test_whole_graph_materializes_and_meets_the_demo_targets(demo_run):
    _, result = demo_run
    assert result.success
    assert {e.asset_key.path[-1] for e in result.get_asset_materialization_events()} == {
        "raw_examples", "training_dataset", "row_group_cache", "base_model", "lora_adapter", "evaluation",
        "promoted_model"}
    report = result.output_for_node("evaluation")
    assert report.trained.loss <= 0.7 * report.base.loss
    assert report.trained.exact_match >= 0.5
    check = next(e for e in result.get_asset_check_evaluations() if e.check_name == "beats_base_model")
    assert check.passed


def test_training_run_records_the_full_lineage_in_mlflow(demo_run):
    home, result = demo_run
    trained = result.output_for_node("lora_adapter")
    dataset = result.output_for_node("training_dataset")
    cache = result.output_for_node("row_group_cache")
    base = result.output_for_node("base_model")
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    run = client.get_run(trained.mlflow_run_id)
    params = run.data.params
    assert LINEAGE_KEYS <= params.keys()
    assert params["dataset_digest"] == dataset.digest
    assert params["cache_version"] == cache.cache_version
    assert params["base_model_digest"] == base.digest
    assert params["partition_keys"] == DEMO_PARTITION
    assert params["dagster_run_id"] == result.run_id
    assert json.loads(params["dataset_paths"]) == [dataset.path]
    assert [d.dataset.digest for d in run.inputs.dataset_inputs] == [dataset.digest[:16]]
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert len(history) == int(run.data.metrics["steps"]) and history[-1].value < history[0].value
    assert run.data.metrics["eval_exact_match"] >= 0.5
    # The reader's counters (rank 0's) reach MLflow next to the loop's telemetry.
    metrics = run.data.metrics
    assert metrics["loader_rows"] > 0 and metrics["loader_batches"] > 0
    assert metrics["loader_cache_hits"] + metrics["loader_cache_misses"] > 0
    assert 0.0 <= metrics["loader_consumer_wait_s"] <= metrics["loader_elapsed_s"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"training_config.json", "deepspeed_config.json", "lineage.json", "loss_curve.png", "step_time.png",
            "model"} <= artifacts
    assert metrics["peak_memory_mb"] > 0  # per worker, on CPU too (the process's peak RSS)
    config = json.loads(Path(client.download_artifacts(run.info.run_id, "deepspeed_config.json")).read_text())
    assert config["zero_optimization"]["stage"] == 2 and "auto" not in json.dumps(config)


def test_training_marks_killed_the_mlflow_run_a_killed_step_pod_left_running(demo_run):
    """The training step hands the Dagster side's judgement (`run_has_ended`) to the MLflow sweep."""
    home, _ = demo_run
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    (left,) = [run for run in client.search_runs(client.get_experiment_by_name("tessera").experiment_id)
               if run.data.params.get("dagster_run_id") == POD_KILLED_DAGSTER_RUN]
    assert left.info.status == "KILLED"
    assert left.data.tags["tessera.ended_by"] == (
        f"a later run: its Dagster run {POD_KILLED_DAGSTER_RUN} had ended (FAILURE)")


def test_promotion_points_champion_at_this_run(demo_run):
    home, result = demo_run
    trained = result.output_for_node("lora_adapter")
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    champion = client.get_model_version_by_alias(REGISTERED_MODEL, CHAMPION_ALIAS)
    assert champion.run_id == trained.mlflow_run_id


def test_dagster_metadata_links_the_mlflow_run_and_data_versions(demo_run):
    _, result = demo_run
    training = _materialization(result, "lora_adapter")
    trained = result.output_for_node("lora_adapter")
    assert trained.mlflow_run_id in training.metadata["mlflow_run"].value
    # Start-up and where steps waited are visible in the UI, not only in MLflow.
    assert training.metadata["time_to_first_step_s"].value > 0.0
    assert 0.0 <= training.metadata["step_time_backward_blocked_s"].value <= training.metadata["step_time_backward_s"].value
    dataset = _materialization(result, "training_dataset")
    assert dataset.tags["dagster/data_version"] == result.output_for_node("training_dataset").digest


def test_state_stays_under_tessera_home(demo_run):
    home, _ = demo_run
    assert {p.name for p in home.iterdir()} >= {"mlflow.db", "mlartifacts", "datasets", "cache", "ray", "models"}


def _training_runs(home: Path) -> list:
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    return client.search_runs([client.get_experiment_by_name("tessera").experiment_id])


def test_no_change_rerun_reuses_training_and_keeps_the_champion(demo_run):
    home, first = demo_run
    runs_before = len(_training_runs(home))
    again = _materialize(home)
    assert again.success
    assert again.output_for_node("training_dataset").digest == first.output_for_node("training_dataset").digest
    training = _materialization(again, "lora_adapter")
    assert training.metadata["reused_earlier_run"].value is True
    assert again.output_for_node("lora_adapter").mlflow_run_id == first.output_for_node("lora_adapter").mlflow_run_id
    assert len(_training_runs(home)) == runs_before
    assert _materialization(again, "promoted_model").metadata["alias_moved"].value is False
    # Same MLflow run, same scores, same registered version: the same data versions, so nothing downstream of
    # a reused training run shows stale in the UI.
    for key in ("lora_adapter", "evaluation", "promoted_model"):
        assert (_materialization(again, key).tags["dagster/data_version"]
                == _materialization(first, key).tags["dagster/data_version"]), key
    assert _materialization(again, "lora_adapter").tags["dagster/data_version"] == training.metadata[
        "mlflow_run_id"].value


def test_failing_check_blocks_promotion_and_keeps_the_champion(demo_run):
    home, first = demo_run
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    champion_before = client.get_model_version_by_alias(REGISTERED_MODEL, CHAMPION_ALIAS)
    weak = _materialize(home, {"ops": {"lora_adapter": {"config": {"max_steps": 2, "learning_rate": 1e-6}}}})
    checks = {e.check_name: e.passed for e in weak.get_asset_check_evaluations()}
    assert checks["not_worse_than_champion"] is False
    assert "promoted_model" not in {e.asset_key.path[-1] for e in weak.get_asset_materialization_events()}
    assert weak.output_for_node("evaluation").failed_gates == ("not_worse_than_champion",)
    # Promoting that partition later, on its own (as from the UI), reads the failed gate off the stored evaluation.
    alone = _materialize(home, selection=["promoted_model"])
    assert not alone.success
    assert "failed not_worse_than_champion" in _failure_message(alone)
    champion_after = client.get_model_version_by_alias(REGISTERED_MODEL, CHAMPION_ALIAS)
    assert champion_after.version == champion_before.version
    assert champion_after.run_id == first.output_for_node("lora_adapter").mlflow_run_id


def test_training_window_spans_the_last_two_days(demo_run):
    # After the champion tests: this trains a model for the next day but does not evaluate or promote it.
    home, first = demo_run
    next_day = "2026-11-02"
    data = _materialize(home, partition_key=next_day, selection=["raw_examples", "training_dataset", "row_group_cache"])
    assert data.success
    trained = _materialize(home, partition_key=next_day, selection=["lora_adapter"],
                           run_config={"ops": {"lora_adapter": {"config": {"max_steps": 20}}}})
    assert trained.success
    run = MlflowClient(f"sqlite:///{home / 'mlflow.db'}").get_run(trained.output_for_node("lora_adapter").mlflow_run_id)
    assert run.data.params["partition_keys"] == f"{DEMO_PARTITION},{next_day}"
    paths = json.loads(run.data.params["dataset_paths"])
    assert paths[0] == first.output_for_node("training_dataset").path
    assert paths[1] == data.output_for_node("training_dataset").path


def test_dataset_checks_pass_on_the_demo_dataset(demo_run):
    _, result = demo_run
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations() if e.asset_key.path[-1] == "training_dataset"}
    assert checks == {name: True for name in ("schema", "no_empty_rows", "no_duplicate_rows", "token_lengths", "no_eval_leakage")}


def _reproduce(home: Path, run_id: str) -> tuple[int, str]:
    from io import StringIO

    from rich.console import Console

    from pipelines.reproduce import reproduce_run

    output = StringIO()
    mp = pytest.MonkeyPatch()
    mp.setenv("TESSERA_HOME", str(home))
    try:
        code = reproduce_run(run_id, Console(file=output, width=200))
    finally:
        mp.undo()
    return code, output.getvalue()


def test_reproduce_reruns_from_lineage_and_matches_exactly(demo_run):
    home, result = demo_run
    original = result.output_for_node("lora_adapter").mlflow_run_id
    code, output = _reproduce(home, original)
    assert code == 0, output
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    (reproduced,) = client.search_runs([client.get_run(original).info.experiment_id],
                                       filter_string=f"tags.reproduces = '{original}'")
    curve = lambda run_id: [m.value for m in client.get_metric_history(run_id, "train_loss")]  # noqa: E731
    assert curve(reproduced.info.run_id) == curve(original)
    assert reproduced.data.metrics["eval_exact_match"] == client.get_run(original).data.metrics["eval_exact_match"]
    assert not list((home / "ray").glob("*reproduce*"))  # a reproduction's checkpoints are removed


def test_evaluation_as_a_ray_task_scores_like_the_step_process_and_records_its_settings(demo_run):
    home, _ = demo_run
    # The latest lora_adapter of this day is the weak one of the gate test, so the champion is scored too. The
    # weak model fails not_worse_than_champion, which fails the step once the evaluation is stored.
    settings = {"batch_size": 16}
    local = _materialize(home, selection=["evaluation"], run_config={"ops": {"evaluation": {"config": settings}}})
    on_ray = _materialize(home, selection=["evaluation"],
                          run_config={"ops": {"evaluation": {"config": {**settings, "on_ray_cluster": True}}}})
    assert (local.output_for_node("evaluation").failed_gates == on_ray.output_for_node("evaluation").failed_gates
            == ("not_worse_than_champion",))
    where = {name: _materialization(result, "evaluation").metadata["evaluated_by"].value
             for name, result in (("local", local), ("ray", on_ray))}
    assert where["local"].endswith(f" pid {os.getpid()}") and not where["ray"].endswith(f" pid {os.getpid()}")
    a, b = local.output_for_node("evaluation"), on_ray.output_for_node("evaluation")
    for metrics_a, metrics_b in ((a.base, b.base), (a.trained, b.trained), (a.champion, b.champion)):
        assert metrics_b.exact_match == metrics_a.exact_match
        assert metrics_b.loss == pytest.approx(metrics_a.loss, rel=1e-5)  # another process, other thread count
    run = MlflowClient(f"sqlite:///{home / 'mlflow.db'}").get_run(b.mlflow_run_id)
    assert {k: v for k, v in run.data.tags.items() if k.startswith("tessera.eval.")} == {
        "tessera.eval.device": "cpu", "tessera.eval.precision": "fp32", "tessera.eval.batch_size": "16"}
    assert run.data.metrics["eval_loss"] == b.trained.loss
    assert not [p for p in (home / "models" / "champion-downloads").iterdir()]  # the champion's copy is removed


def test_a_champion_whose_artifacts_are_gone_is_named_and_not_compared(demo_run):
    home, first = demo_run
    champion_run = first.output_for_node("lora_adapter").mlflow_run_id
    artifacts = next(p for p in (home / "mlartifacts").rglob(champion_run) if p.is_dir())
    aside = artifacts.with_name(f"{artifacts.name}-aside")
    artifacts.rename(aside)  # the artifact store lost the champion's files
    try:
        # the latest lora_adapter of this day is the weak one of the gate test: it would be compared
        result = _materialize(home, selection=["evaluation"],
                              run_config={"ops": {"evaluation": {"config": {"max_loss_ratio": 2.0}}}})
    finally:
        aside.rename(artifacts)
    assert result.success
    check = next(e for e in result.get_asset_check_evaluations() if e.check_name == "not_worse_than_champion")
    assert check.passed and check.metadata["compared"].value is False
    assert check.description.startswith(f"not compared: tessera-adapter version 1 (MLflow run {champion_run}), "
                                         "alias 'champion': its model artifacts cannot be downloaded")
    assert result.output_for_node("evaluation").champion is None


def test_reproduce_refuses_when_the_dataset_changed(demo_run):
    # Runs last in this module: it alters the published dataset.
    home, result = demo_run
    dataset = Path(result.output_for_node("training_dataset").path)
    (dataset / "manifest.json").write_text((dataset / "manifest.json").read_text() + " ")
    code, output = _reproduce(home, result.output_for_node("lora_adapter").mlflow_run_id)
    assert code == 2
    assert "content changed" in output and str(dataset)[:20] in output.replace("\n", "")
    assert "manifest.json (changed)" in output.replace("\n", "")  # from the digests kept at publication


def test_a_day_whose_dataset_failed_its_checks_is_refused_by_consumers_launched_later(demo_run, tmp_path):
    # After the tests that read the demo day's stored dataset: this replaces it with one failing a check.
    from training_core.data.demo_task import generate_records

    home, _ = demo_run
    repeated = tmp_path / "repeated.jsonl"
    records = generate_records("x", 200) + [generate_records("y", 1)[0]] * 300
    repeated.write_text("".join(json.dumps(record) + "\n" for record in records))
    bad_day = _materialize(home, {"ops": {"raw_examples": {"config": {"source": str(repeated)}}}},
                           selection=["raw_examples", "training_dataset"])
    assert {e.check_name: e.passed for e in bad_day.get_asset_check_evaluations()}["no_duplicate_rows"] is False
    assert bad_day.output_for_node("training_dataset").failed_checks == ("no_duplicate_rows",)
    # Blocking checks stop consumers only within that run: launched later on their own, they read the
    # verdict stored with the dataset. The next day's training window holds the failed day.
    cache = _materialize(home, selection=["row_group_cache"])
    assert not cache.success and f"{DEMO_PARTITION} failed no_duplicate_rows" in _failure_message(cache)
    next_day = _materialize(home, partition_key="2026-11-02", selection=["lora_adapter"])
    assert not next_day.success
    assert f"lora_adapter refuses training_dataset partition(s) whose blocking checks failed: {DEMO_PARTITION} " \
           "failed no_duplicate_rows" in _failure_message(next_day)
