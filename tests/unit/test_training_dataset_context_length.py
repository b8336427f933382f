"""training_dataset refuses a seq_len longer than the base model's context before it writes a row:
otherwise the day is tokenized, packed and cached, Ray started, and only lora_adapter refuses it."""

from __future__ import annotations

import dagster as dg

from pipelines.graph import ASSETS
from pipelines.resources_local import local_resources


def test_a_seq_len_beyond_the_base_models_context_is_refused_before_any_dataset_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    run_config = {"ops": {"raw_examples": {"config": {"records_per_partition": 200}},
                          "training_dataset": {"config": {"seq_len": 512}}}}
    result = dg.materialize(ASSETS, selection=["base_model", "raw_examples", "training_dataset"],
                            partition_key="2026-11-01", resources=local_resources(), run_config=run_config,
                            instance=dg.DagsterInstance.ephemeral(), raise_on_error=False)
    failures = {e.step_key: e.step_failure_data.error for e in result.get_step_failure_events()}
    assert set(failures) == {"training_dataset"}
    error = failures["training_dataset"]
    while error.cause is not None and error.cls_name == "DagsterExecutionStepExecutionError":
        error = error.cause
    (base_model,) = [e.materialization.metadata["name_or_path"].value for e in result.get_asset_materialization_events()
                     if e.asset_key == dg.AssetKey("base_model")]
    assert error.cls_name == "ConfigError"
    assert error.message.startswith(
        f"training_core.errors.ConfigError: training rows of seq_len=512 are longer than base model {base_model} "
        "allows (max_position_embeddings=256); lower seq_len (training_dataset config)")
    assert not (tmp_path / "datasets" / "training").exists()  # nothing written, nothing to clean up
    assert (tmp_path / "datasets" / "raw" / "2026-11-01").exists()  # upstream ran: only the refusal stopped it


def test_a_seq_len_equal_to_the_context_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    run_config = {"ops": {"raw_examples": {"config": {"records_per_partition": 200}},
                          "training_dataset": {"config": {"seq_len": 256}}}}
    result = dg.materialize(ASSETS, selection=["base_model", "raw_examples", "training_dataset"],
                            partition_key="2026-11-01", resources=local_resources(), run_config=run_config,
                            instance=dg.DagsterInstance.ephemeral(), raise_on_error=False)
    assert result.success
    assert any((tmp_path / "datasets" / "training" / "2026-11-01").iterdir())
