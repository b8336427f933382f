"""Evaluation refuses bad inputs early, naming them: gate settings, an empty held-out split, and a
missing or damaged trained model folder (named before the base model is evaluated)."""

from __future__ import annotations

import re
import shutil

import dagster as dg
import pydantic
import pytest

from assets.evaluation_assets import EvaluationConfig, _beats_base_model, _not_worse_than_champion
from pipelines.definitions import defs
from training_core.base_model import load_tokenizer
from training_core.data.dataset_writer import DatasetSpec, write_dataset
from training_core.data.demo_task import generate_records
from training_core.data.packing import is_eval_example
from training_core.errors import EmptyPartitionError
from training_core.evaluate.compare import EvaluationReport, evaluate_against_base
from training_core.evaluate.model_folder import TrainedModelError, check_trained_model_dir
from training_core.evaluate.results import EvalMetrics

# --- gate settings -------------------------------------------------------------------------------


def test_evaluation_config_defaults_are_the_documented_gates():
    config = EvaluationConfig()
    assert (config.max_loss_ratio, config.champion_tolerance) == (1.0, 0.05)


@pytest.mark.parametrize(("values", "field"), [
    ({"max_loss_ratio": 0.0}, "max_loss_ratio"), ({"max_loss_ratio": -1.0}, "max_loss_ratio"),
    ({"max_loss_ratio": float("nan")}, "max_loss_ratio"), ({"max_loss_ratio": float("inf")}, "max_loss_ratio"),
    ({"champion_tolerance": -0.01}, "champion_tolerance"), ({"champion_tolerance": float("nan")}, "champion_tolerance"),
])
def test_gate_settings_out_of_range_are_refused_with_the_field_named(values, field):
    with pytest.raises(pydantic.ValidationError, match=field):
        EvaluationConfig(**values)


@pytest.mark.parametrize(("config", "message"), [
    ({"max_loss_ratio": "low"}, r"root:ops:evaluation:config:max_loss_ratio"),
    ({"max_loss": 0.9}, r'unexpected config entry "max_loss" at path root:ops:evaluation:config'),
])
def test_a_launch_with_a_mistyped_or_unknown_gate_setting_is_refused_by_dagster(config, message):
    job = defs.resolve_job_def("train_and_promote")
    with pytest.raises(dg.DagsterInvalidConfigError, match=message):
        dg.validate_run_config(job, {"ops": {"evaluation": {"config": config}}})


def test_a_launch_may_set_the_gates():
    job = defs.resolve_job_def("train_and_promote")
    resolved = dg.validate_run_config(job, {"ops": {"evaluation": {"config": {"max_loss_ratio": 0.9,
                                                                             "champion_tolerance": 0.0}}}})
    assert resolved["ops"]["evaluation"]["config"] == {"max_loss_ratio": 0.9, "champion_tolerance": 0.0}


def _report(trained_loss: float, champion_loss: float | None = None) -> EvaluationReport:
    def metrics(loss):
        return EvalMetrics(loss=loss, perplexity=2.0, exact_match=0.0, examples=4)

    return EvaluationReport(metrics(2.0), metrics(trained_loss), "model", "run",
                            metrics(champion_loss) if champion_loss is not None else None)


def test_the_gates_use_the_configured_limits():
    report = _report(trained_loss=1.9, champion_loss=1.7)  # ratio 0.95; 11.8 % above the champion
    assert _beats_base_model(report, max_loss_ratio=1.0).passed is True
    assert _beats_base_model(report, max_loss_ratio=0.9).passed is False
    assert _not_worse_than_champion(report, "champ", champion_tolerance=0.05).passed is False
    assert _not_worse_than_champion(report, "champ", champion_tolerance=0.2).passed is True


# --- empty held-out split ------------------------------------------------------------------------


def test_a_partition_with_no_eval_records_is_refused_when_the_dataset_is_written(tmp_path, demo_model):
    tokenizer = load_tokenizer(demo_model.name_or_path)
    records = generate_records("2026-11-05", 400)
    train_only = [r for r in records if not is_eval_example(r["prompt"], 0.05)][:20]
    with pytest.raises(EmptyPartitionError, match=r"partition 2026-11-05: none of its 20 records fell into the eval "
                                                  r"split \(eval_fraction=0\.05.*raise eval_fraction or add records"):
        write_dataset(train_only, tokenizer, tmp_path, DatasetSpec(), source_label="partition 2026-11-05")
    assert list(tmp_path.iterdir()) == []

    held_out = next(r for r in records if is_eval_example(r["prompt"], 0.05))
    dataset = write_dataset([*train_only, held_out], tokenizer, tmp_path, DatasetSpec(), source_label="p")
    assert (dataset.train_examples, dataset.eval_examples) == (20, 1)


# --- trained model folder ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter_dir(demo_model, tmp_path_factory):
    """A LoRA adapter over the demo model, saved as training saves it (not trained: only its files matter)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(demo_model.name_or_path)
    folder = tmp_path_factory.mktemp("adapter") / "model"
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).save_pretrained(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    return folder


class _RecordsThatMustNotBeRead(list):
    """Held-out records whose reading proves the base model was evaluated before the folder was checked."""

    def __iter__(self):
        raise AssertionError("the base model was evaluated before the trained model folder was checked")


def _truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[: keep(len(data))])


DAMAGE = {
    "missing": (lambda folder: shutil.rmtree(folder), r"does not exist"),
    "empty": (lambda folder: [p.unlink() for p in folder.iterdir()], r"is empty"),
    "garbled config": (lambda folder: (folder / "adapter_config.json").write_text('{"r": 4,'),
                       r"adapter_config\.json is not readable JSON"),
    "no weights": (lambda folder: (folder / "adapter_model.safetensors").unlink(),
                   r"has adapter_config\.json but no weights \(adapter_model\.safetensors or adapter_model\.bin\)"),
    "empty weights": (lambda folder: _truncate(folder / "adapter_model.safetensors", lambda n: 0),
                      r"adapter_model\.safetensors is empty"),
    "truncated weights": (lambda folder: _truncate(folder / "adapter_model.safetensors", lambda n: n // 2),
                          r"adapter_model\.safetensors is \d+ bytes, but its header describes \d+"),
    "garbled header": (lambda folder: (folder / "adapter_model.safetensors").write_bytes(
                           (folder / "adapter_model.safetensors").read_bytes()[:8] + b"\xff" * 4000),
                       r"adapter_model\.safetensors has a damaged safetensors header"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_adapter_folder_is_named_before_the_base_model_is_evaluated(damage, adapter_dir, demo_model, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(adapter_dir, folder)
    apply, message = DAMAGE[damage]
    apply(folder)
    records = _RecordsThatMustNotBeRead([{"prompt": "encode: a", "response": "b"}])
    with pytest.raises(TrainedModelError, match=rf"trained model folder {re.escape(str(folder))}: {message}"):
        evaluate_against_base(demo_model.name_or_path, str(folder), records)


def test_a_sound_adapter_and_a_full_model_pass_the_check_and_load(adapter_dir, demo_model):
    from peft import PeftModel

    from training_core.evaluate.metrics import load_model_for_eval

    assert check_trained_model_dir(adapter_dir) == "adapter"
    assert check_trained_model_dir(demo_model.name_or_path) == "full"
    model = load_model_for_eval(demo_model.name_or_path, str(adapter_dir))
    assert isinstance(model, PeftModel) and model.training is False


def test_a_full_model_with_truncated_weights_is_named(demo_model, tmp_path):
    folder = tmp_path / "full"
    shutil.copytree(demo_model.name_or_path, folder)
    _truncate(folder / "model.safetensors", lambda n: n - 100)
    with pytest.raises(TrainedModelError, match=rf"{re.escape(str(folder))}: model\.safetensors is \d+ bytes"):
        check_trained_model_dir(folder)


def test_damage_the_check_cannot_see_is_named_when_the_adapter_loads(adapter_dir, demo_model, tmp_path):
    from training_core.evaluate.metrics import load_model_for_eval

    folder = tmp_path / "model"
    shutil.copytree(adapter_dir, folder)
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.bin").write_bytes(b"not a torch checkpoint")  # non-empty: passes the precheck
    assert check_trained_model_dir(folder) == "adapter"
    with pytest.raises(TrainedModelError, match=rf"trained model folder {re.escape(str(folder))}: could not be loaded "
                                                r"as a PEFT adapter over .*\(\w+Error: "):
        load_model_for_eval(demo_model.name_or_path, str(folder))
