"""The champion is compared over the weights it trained on, and only a run whose artifacts hold a model
is promoted: a real SQLite MLflow store, real tiny models."""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import pytest

from tests.unit.test_mlflow_tracking import log_adapter_files
from training_core.base_model import TinyLlamaSpec, build_demo_model, load_tokenizer, resolve_pretrained
from training_core.data.dataset_writer import DatasetSpec, write_dataset
from training_core.data.demo_task import generate_records, tokenizer_corpus
from training_core.errors import LineageError
from training_core.evaluate.compare import EvaluationReport
from training_core.evaluate.results import EvalMetrics
from training_core.registry import ModelRegistry
from training_core.tracking import MlflowTracking


@pytest.fixture(scope="module")
def adapter_dir(demo_model, tmp_path_factory):
    """A LoRA adapter over the demo model, saved as training saves it (not trained: only its files matter)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(demo_model.name_or_path)
    folder = tmp_path_factory.mktemp("adapter") / "model"
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory):
    """The demo architecture and tokenizer with other weights (another seed)."""
    return build_demo_model(tokenizer_corpus(), TinyLlamaSpec(seed=1), tmp_path_factory.mktemp("other-weights"))


def _user_base_model(demo_model, folder: Path) -> Path:
    """A user's base-model folder: the demo model's files, its own per-file record included."""
    shutil.copytree(demo_model.name_or_path, folder)
    return folder


def _promote_champion_trained_on(tracking: MlflowTracking, registry: ModelRegistry, base, adapter_dir) -> str:
    run_id = tracking.start_run("champion", tags={})
    tracking.log_batch(run_id, params={"base_model": base.name_or_path, "base_model_digest": base.digest})
    tracking.client.log_artifacts(run_id, str(adapter_dir), "model")
    registry.promote(run_id)
    return run_id


def test_a_champion_whose_base_model_folder_was_replaced_in_place_is_not_scored_over_the_new_weights(
        tmp_path, demo_model, other_weights, adapter_dir):
    from assets.evaluation_assets import CHAMPION_ALIAS, REGISTERED_MODEL, EvaluationConfig, evaluation
    from assets.training_assets import TrainedModel
    from resources import MlflowTracker, TesseraStorage

    storage = TesseraStorage(home=str(tmp_path / "home"))
    mlflow_tracker = MlflowTracker(storage=storage)
    tracking = mlflow_tracker.client()
    user_base = _user_base_model(demo_model, tmp_path / "userbase")
    trained_on = resolve_pretrained(str(user_base), storage.base_model_digests)
    champion_run = _promote_champion_trained_on(tracking, ModelRegistry(tracking, REGISTERED_MODEL, CHAMPION_ALIAS),
                                                trained_on, adapter_dir)
    # Other weights under the same path, same tokenizer: the champion's adapter over them is another model.
    shutil.copy2(Path(other_weights.name_or_path) / "model.safetensors", user_base / "model.safetensors")
    base_now = resolve_pretrained(str(user_base), storage.base_model_digests)
    trained_run = tracking.start_run("trained", tags={})
    dataset = write_dataset(generate_records("2026-11-01", 400), load_tokenizer(base_now.name_or_path),
                            tmp_path / "datasets", DatasetSpec(), source_label="partition 2026-11-01")

    outputs = list(evaluation(
        dg.build_asset_context(partition_key="2026-11-01"), config=EvaluationConfig(), mlflow_tracker=mlflow_tracker,
        storage=storage, ray_cluster=None, training_dataset={"2026-11-01": dataset}, base_model=base_now,
        lora_adapter=TrainedModel(str(adapter_dir), "lora", trained_run, base_now.name_or_path, dataset.digest, 1.0)))

    report = next(o.value for o in outputs if isinstance(o, dg.Output))
    assert report.champion is None and report.champion_run_id == champion_run
    check = next(o for o in outputs if isinstance(o, dg.AssetCheckResult) and o.check_name == "not_worse_than_champion")
    assert check.passed is True and check.metadata["compared"].value is False
    assert check.description == (
        f"not compared: tessera-adapter version 1 (MLflow run {champion_run}), alias 'champion': its base model "
        f"{user_base} changed since that run trained on it (model.safetensors (changed)), so the version as trained "
        "cannot be loaded: over the weights there now it is another model; a model that passes the other gate "
        "replaces it as champion")


def test_the_recorded_file_digests_name_a_replaced_base_model_even_when_its_own_record_was_replaced_too(
        tmp_path, demo_model, other_weights, adapter_dir):
    # Copying another model's files over the folder, its hidden per-file record included: only the
    # record kept outside the folder at the champion's training still describes what it trained on.
    records = tmp_path / "base-digests"
    user_base = _user_base_model(demo_model, tmp_path / "userbase")
    trained_on = resolve_pretrained(str(user_base), records)
    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    registry = ModelRegistry(tracking, "adapter", "champion", base_digest_records=records)
    champion_run = _promote_champion_trained_on(tracking, registry, trained_on, adapter_dir)
    assert registry.champion().tags["tessera.base_model_digest"] == trained_on.digest
    assert registry.base_model_of(registry.champion()) == str(user_base)  # unchanged: comparable

    for file in Path(other_weights.name_or_path).iterdir():
        shutil.copy2(file, user_base / file.name)
    with pytest.raises(LineageError, match=rf"^adapter version 1 \(MLflow run {champion_run}\), alias 'champion': its "
                                           rf"base model {user_base} changed since that run trained on it "
                                           r"\(model\.safetensors \(changed\)\)"):
        registry.base_model_of(registry.champion())


def test_a_run_whose_model_artifacts_hold_no_model_is_not_promoted_and_the_champion_stays(tmp_path):
    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    registry = ModelRegistry(tracking, "adapter", "champion")
    champion, emptied, weights_only = (tracking.start_run(name, tags={}) for name in ("champion", "emptied", "weights"))
    for run_id in (champion, emptied):
        log_adapter_files(tracking, run_id, tmp_path / run_id)
    registry.promote(champion)
    shutil.rmtree(tmp_path / "artifacts" / emptied / "artifacts" / "model")  # the artifact store lost its files
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"weights")
    tracking.client.log_artifacts(weights_only, str(tmp_path / "weights"), "model")

    for run_id, found in ((emptied, "it is empty or gone"), (weights_only, "it holds model.safetensors")):
        folder = f"{(tmp_path / 'artifacts').resolve().as_uri()}/{run_id}/artifacts/model"
        with pytest.raises(LineageError) as refused:
            registry.promote(run_id)
        assert str(refused.value) == (
            f"not promoting: MLflow run {run_id}: its model artifacts ({folder}) hold neither adapter_config.json "
            f"(a PEFT adapter) nor config.json (a full model): {found}; train the model again; nothing was "
            "registered, 'champion' stays where it is")
    assert registry.champion().run_id == champion
    assert [v.run_id for v in tracking.client.search_model_versions("name = 'adapter'")] == [champion]


def test_a_base_model_that_scores_a_held_out_loss_of_zero_is_named_instead_of_dividing_by_it():
    from training_core.evaluate.compare import BaseLossZeroError

    certain = EvalMetrics(loss=0.0, perplexity=1.0, exact_match=1.0, examples=12)
    report = EvaluationReport(certain, certain, "model", "run-1")
    with pytest.raises(BaseLossZeroError, match=r"^MLflow run run-1: the base model scores a held-out loss of 0 on 12 "
                                                r"examples .* no trained model can beat it; check the held-out records"):
        report.as_metrics()
