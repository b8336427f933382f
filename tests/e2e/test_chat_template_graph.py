"""An instruct model's chat template through the whole graph: a user's model folder whose tokenizer ships a
template, a day's dataset written with prompt_format='chat_template', trained and evaluated in that layout
(real Dagster, Ray, DeepSpeed, PEFT and MLflow, a short training)."""

from __future__ import annotations

from io import StringIO

import dagster as dg
import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from rich.console import Console

from pipelines.cli import step_failures
from pipelines.graph import ASSETS
from pipelines.reproduce import reproduce_run
from pipelines.resources_local import local_resources
from tests.unit.tokenizer_support import chat_model_folder

pytestmark = pytest.mark.e2e

DAY = "2026-11-01"


def _metadata(result, key: str) -> dict:
    event = next(e for e in result.get_asset_materialization_events() if e.asset_key.path[-1] == key)
    return {name: value.value for name, value in event.materialization.metadata.items()}


def test_a_chat_template_day_trains_and_is_evaluated_in_the_templates_layout(ray_session, tmp_path, monkeypatch):
    from training_core.data.dataset_writer import read_eval_records
    from training_core.data.prompt_format import CHAT_TEMPLATE, PLAIN
    from training_core.evaluate.compare import evaluate_trained

    folder = chat_model_folder(tmp_path / "instruct-model")
    home = tmp_path / "home"
    (home / "dagster").mkdir(parents=True)
    monkeypatch.setenv("TESSERA_HOME", str(home))
    ops = {
        "base_model": {"config": {"name_or_path": str(folder)}},
        "raw_examples": {"config": {"records_per_partition": 800}},
        "training_dataset": {"config": {"prompt_format": CHAT_TEMPLATE}},
        "lora_adapter": {"config": {"max_steps": 25, "num_workers": 1, "checkpoint_every_steps": 100,
                                    "warmup_steps": 2}},
    }
    result = dg.materialize(ASSETS, partition_key=DAY, resources=local_resources(), run_config={"ops": ops},
                            instance=dg.DagsterInstance.local_temp(str(home / "dagster")), raise_on_error=False)
    assert result.success, step_failures(result)

    dataset = _metadata(result, "training_dataset")
    assert dataset["prompt_format"] == CHAT_TEMPLATE
    assert all(e.passed for e in result.get_asset_check_evaluations() if e.asset_key.path[-1] == "training_dataset")
    # The evaluation asset scored the held-out prompts as the dataset laid them out: recomputed here.
    records = read_eval_records(dataset["dataset_path"])
    model_dir = _metadata(result, "lora_adapter")["model_dir"]
    evaluation = _metadata(result, "evaluation")
    chat = evaluate_trained(str(folder), model_dir, records, prompt_format=CHAT_TEMPLATE)
    plain = evaluate_trained(str(folder), model_dir, records, prompt_format=PLAIN)
    assert np.isclose(evaluation["eval_loss"], chat.loss, rtol=1e-5)
    assert not np.isclose(evaluation["eval_loss"], plain.loss, rtol=1e-3)
    assert evaluation["eval_loss"] < evaluation["eval_base_loss"]  # it trained on the layout it is scored in

    # `tessera reproduce` scores its rerun in the recorded datasets' layout too: the metrics match.
    original = result.output_for_node("lora_adapter").mlflow_run_id
    output = StringIO()
    assert reproduce_run(original, Console(file=output, width=200)) == 0, output.getvalue()
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    (reproduced,) = client.search_runs([client.get_run(original).info.experiment_id],
                                       filter_string=f"tags.reproduces = '{original}'")
    assert reproduced.data.metrics["eval_loss"] == client.get_run(original).data.metrics["eval_loss"]
    # whoever serves the model reads how its prompts were laid out from the run
    assert {client.get_run(r).data.tags["prompt_format"] for r in (original, reproduced.info.run_id)} == {CHAT_TEMPLATE}
