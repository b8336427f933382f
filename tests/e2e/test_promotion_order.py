"""Which model `champion` holds after days are trained out of order, re-run, or evaluated over another
base model: real Dagster, Ray, DeepSpeed, PEFT and MLflow on a small, short training."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from mlflow.tracking import MlflowClient

from assets.evaluation_assets import CHAMPION_ALIAS, REGISTERED_MODEL
from pipelines.cli import step_failures
from pipelines.graph import ASSETS
from pipelines.resources_local import local_resources

pytestmark = pytest.mark.e2e

EARLIER, LATER = "2026-11-01", "2026-11-02"
DAY_DATA = ["raw_examples", "base_model", "training_dataset", "row_group_cache"]
# Short training on one worker; a champion tolerance wide enough that every model here passes its gates,
# so what is tested is the promotion's own decision.
SMALL = {
    "raw_examples": {"config": {"records_per_partition": 800}},
    "lora_adapter": {"config": {"max_steps": 25, "num_workers": 1, "checkpoint_every_steps": 100, "warmup_steps": 2}},
    "evaluation": {"config": {"champion_tolerance": 0.9}},
}


def _materialize(home: Path, partition_key: str | None, selection: list[str] | None = None, **extra_config):
    """One persistent Dagster instance per home, so later runs load earlier outputs (like the UI)."""
    (home / "dagster").mkdir(parents=True, exist_ok=True)
    ops = {asset: {"config": dict(values["config"])} for asset, values in SMALL.items()}
    for asset, values in extra_config.items():
        ops.setdefault(asset, {"config": {}})["config"].update(values)
    if selection is not None:
        ops = {asset: values for asset, values in ops.items() if asset in selection}
    mp = pytest.MonkeyPatch()
    mp.setenv("TESSERA_HOME", str(home))
    try:
        return dg.materialize(ASSETS, partition_key=partition_key, resources=local_resources(),
                              instance=dg.DagsterInstance.local_temp(str(home / "dagster")),
                              run_config={"ops": ops}, selection=selection, raise_on_error=False)
    finally:
        mp.undo()


def _metadata(result, key: str) -> dict:
    event = next(e for e in result.get_asset_materialization_events() if e.asset_key.path[-1] == key)
    return {name: value.value for name, value in event.materialization.metadata.items()}


def _failure_message(result) -> str:
    return "; ".join(f"{step}: {error}" for step, error in step_failures(result))


def _champion_run(home: Path) -> str:
    return MlflowClient(f"sqlite:///{home / 'mlflow.db'}").get_model_version_by_alias(
        REGISTERED_MODEL, CHAMPION_ALIAS).run_id


@pytest.fixture(scope="module")
def later_day_champion(ray_session, tmp_path_factory):
    """The later day trained and promoted first (its window needs the earlier day's data): a backfill run
    newest first, or a re-run of an earlier day after the schedule moved on."""
    home = tmp_path_factory.mktemp("tessera-home")
    assert _materialize(home, EARLIER, DAY_DATA).success
    later = _materialize(home, LATER)
    assert later.success, _failure_message(later)
    later_run = later.output_for_node("lora_adapter").mlflow_run_id
    assert _champion_run(home) == later_run
    return home, later_run


def test_an_earlier_days_model_does_not_replace_a_later_days_champion(later_day_champion):
    home, later_run = later_day_champion
    earlier = _materialize(home, EARLIER)
    assert earlier.success, _failure_message(earlier)
    earlier_run = earlier.output_for_node("lora_adapter").mlflow_run_id
    assert earlier.output_for_node("evaluation").champion_run_id == later_run  # compared, passed its gates
    promotion = _metadata(earlier, "promoted_model")
    assert promotion["alias_moved"] is False
    assert promotion["candidate_run_id"] == earlier_run and promotion["mlflow_run_id"] == later_run
    assert promotion["alias_kept_because"].startswith(
        f"partition {EARLIER} (MLflow run {earlier_run}) is older than {LATER}, the day champion "
        f"{REGISTERED_MODEL} version 1 (MLflow run {later_run}) trained for")
    assert earlier.output_for_node("promoted_model").run_id == later_run
    assert _champion_run(home) == later_run


def test_a_no_change_rerun_of_an_earlier_day_leaves_the_champion_alone_and_a_rollback_is_explicit(
        later_day_champion):
    # After the test above: the earlier day's model is trained and evaluated, the later day's is champion.
    home, later_run = later_day_champion
    rerun = _materialize(home, EARLIER)
    assert rerun.success, _failure_message(rerun)
    assert _metadata(rerun, "lora_adapter")["reused_earlier_run"] is True
    assert _metadata(rerun, "promoted_model")["alias_moved"] is False
    assert _champion_run(home) == later_run
    # A deliberate rollback to the earlier day's model says so.
    rollback = _materialize(home, EARLIER, ["promoted_model"], promoted_model={"allow_older_day": True})
    assert rollback.success, _failure_message(rollback)
    assert _metadata(rollback, "promoted_model")["alias_moved"] is True
    assert _champion_run(home) == rerun.output_for_node("lora_adapter").mlflow_run_id


def test_evaluation_refuses_an_adapter_trained_on_another_base_model(later_day_champion):
    # Runs last: it replaces base_model.
    home, _ = later_day_champion
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    trained = _materialize(home, EARLIER, ["lora_adapter"])  # reused: the adapter evaluation would load
    assert trained.success, _failure_message(trained)
    adapter = trained.output_for_node("lora_adapter")
    training_run = client.get_run(adapter.mlflow_run_id).data
    trained_on = training_run.params["base_model_digest"]
    other_base = _materialize(home, None, ["base_model"], base_model={"demo_seed": 1})
    assert other_base.success
    base_now = other_base.output_for_node("base_model")
    assert base_now.digest != trained_on

    evaluated = _materialize(home, EARLIER, ["evaluation"])
    assert not evaluated.success
    assert _failure_message(evaluated) == "evaluation: training_core.errors.LineageError: " + (
        f"lora_adapter of partition {EARLIER} (MLflow run {adapter.mlflow_run_id}) was trained on base model "
        f"{adapter.base_model} (digest {trained_on[:12]}), but base_model is now "
        f"{base_now.name_or_path} (digest {base_now.digest[:12]}); rematerialize lora_adapter for partition "
        f"{EARLIER} to train on it (nothing was evaluated or logged)")
    assert client.get_run(adapter.mlflow_run_id).data.metrics == training_run.metrics  # eval_loss not overwritten
