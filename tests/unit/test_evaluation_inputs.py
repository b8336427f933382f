"""Evaluation refuses bad inputs early, naming them: gate settings, an empty held-out split, and a
missing or damaged trained model folder (named before the base model is evaluated)."""

from __future__ import annotations

import re
import shutil

import dagster as dg
import pydantic
import pytest

from assets.evaluation_assets import EvaluationConfig
from pipelines.definitions import defs
from training_core.base_model import load_tokenizer
from training_core.data.dataset_writer import DatasetSpec, write_dataset
from training_core.data.demo_task import generate_records
from training_core.errors import EmptyPartitionError
from training_core.evaluate.compare import evaluate_against_base
from training_core.evaluate.model_folder import TrainedModelError, check_trained_model_dir
from training_core.errors import ConfigError
from training_core.evaluate.on_ray import task_resources
from training_core.evaluate.settings import EvalSettings

from .tokenizer_support import is_eval_prompt

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
    config = resolved["ops"]["evaluation"]["config"]
    assert (config["max_loss_ratio"], config["champion_tolerance"]) == (0.9, 0.0)


# --- where and how evaluation runs ----------------------------------------------------------------


def test_a_launch_may_choose_device_precision_batch_size_and_the_ray_cluster():
    job = defs.resolve_job_def("train_and_promote")
    chosen = {"device": "cuda", "precision": "bf16", "batch_size": 8, "on_ray_cluster": True}
    resolved = dg.validate_run_config(job, {"ops": {"evaluation": {"config": chosen}}})
    assert {k: resolved["ops"]["evaluation"]["config"][k] for k in chosen} == chosen
    assert EvaluationConfig(**chosen).settings() == EvalSettings("cuda", "bf16", 8)


@pytest.mark.parametrize(("config", "message"), [
    ({"device": "tpu"}, r"root:ops:evaluation:config:device"),
    ({"precision": "fp16"}, r"root:ops:evaluation:config:precision"),
])
def test_an_unknown_device_or_precision_is_refused_at_launch(config, message):
    job = defs.resolve_job_def("train_and_promote")
    with pytest.raises(dg.DagsterInvalidConfigError, match=message):
        dg.validate_run_config(job, {"ops": {"evaluation": {"config": config}}})


def test_a_batch_size_below_one_is_refused_naming_it():
    with pytest.raises(pydantic.ValidationError, match="batch_size"):
        EvaluationConfig(batch_size=0)


@pytest.mark.parametrize(("settings", "message"), [
    (dict(device="gpu"), r"evaluation device must be one of auto, cpu, cuda, got 'gpu'"),
    (dict(precision="fp16"), r"evaluation precision must be one of fp32, bf16, got 'fp16'"),
    (dict(batch_size=0), r"evaluation batch_size must be a positive integer, got 0"),
    (dict(batch_size=True), r"evaluation batch_size must be a positive integer, got True"),
    (dict(device="cpu", precision="bf16"), r"precision='bf16' needs a GPU"),
])
def test_impossible_settings_are_refused_before_any_model_loads(settings, message):
    with pytest.raises(ConfigError, match=message):
        EvalSettings(**settings)


def test_auto_means_the_gpu_only_where_the_evaluating_process_sees_one():
    assert EvalSettings().resolve(cuda_available=False) == EvalSettings("cpu", "fp32", 64)
    assert EvalSettings().resolve(cuda_available=True) == EvalSettings("cuda", "fp32", 64)
    assert EvalSettings("auto", "bf16", 8).resolve(cuda_available=True) == EvalSettings("cuda", "bf16", 8)
    with pytest.raises(ConfigError, match=r"precision='bf16' needs a GPU, and the process that evaluates sees no"):
        EvalSettings("auto", "bf16").resolve(cuda_available=False)
    with pytest.raises(ConfigError, match=r"device='cuda' but the process that evaluates sees no CUDA GPU"):
        EvalSettings("cuda").resolve(cuda_available=False)


def test_settings_round_trip_through_mlflow_tags_and_old_runs_read_as_cpu_fp32():
    settings = EvalSettings("cuda", "bf16", 16)
    assert settings.as_tags() == {"tessera.eval.device": "cuda", "tessera.eval.precision": "bf16",
                                  "tessera.eval.batch_size": "16"}
    assert EvalSettings.from_tags({"other": "x", **settings.as_tags()}) == settings
    assert EvalSettings.from_tags({}) == EvalSettings("cpu", "fp32", 64)  # evaluated before the tags existed
    with pytest.raises(ConfigError, match=r"tessera\.eval\.batch_size is not an integer: 'many'"):
        EvalSettings.from_tags({"tessera.eval.batch_size": "many"})


@pytest.mark.parametrize(("device", "cluster_has_gpu", "gpus"), [
    ("auto", False, 0), ("auto", True, 1), ("cpu", True, 0), ("cuda", True, 1),
])
def test_a_ray_evaluation_task_asks_for_a_gpu_only_when_it_will_use_one(device, cluster_has_gpu, gpus):
    assert task_resources(device, cluster_has_gpu) == {"num_cpus": 1, "num_gpus": gpus}


def test_asking_for_cuda_on_a_cluster_without_gpus_fails_instead_of_waiting_for_ever():
    from training_core.evaluate.compare import EvaluationJob
    from training_core.evaluate.on_ray import evaluate_on_ray

    job = EvaluationJob("base", "trained", [{"prompt": "p", "response": "r"}], EvalSettings("cuda"))
    with pytest.raises(ConfigError, match=r"device='cuda' with on_ray_cluster=True, but the Ray cluster has no GPU"):
        evaluate_on_ray(job, cluster_has_gpu=False)


def test_batch_size_changes_only_how_examples_are_grouped(adapter_dir, demo_model):
    from training_core.evaluate.compare import evaluate_trained

    records = generate_records("2026-11-05", 12)
    one = evaluate_trained(demo_model.name_or_path, str(adapter_dir), records, settings=EvalSettings("cpu", "fp32", 1))
    many = evaluate_trained(demo_model.name_or_path, str(adapter_dir), records, settings=EvalSettings("cpu", "fp32", 64))
    assert one.examples == many.examples == 12
    assert one.exact_match == many.exact_match
    assert one.loss == pytest.approx(many.loss, rel=1e-5)


# --- comparing with the champion ------------------------------------------------------------------


def test_the_champion_is_compared_only_when_both_tokenize_alike(demo_model, tmp_path):
    from training_core.base_model import train_demo_tokenizer
    from training_core.evaluate.compare import champion_not_comparable

    same_tokenizer = tmp_path / "same-tokenizer"  # another base model folder, same tokenizer files
    shutil.copytree(demo_model.name_or_path, same_tokenizer)
    other_tokenizer = tmp_path / "other-tokenizer"
    train_demo_tokenizer(["alpha beta gamma delta", "epsilon zeta"]).save_pretrained(other_tokenizer)

    assert champion_not_comparable(demo_model.name_or_path, demo_model.name_or_path) is None
    assert champion_not_comparable(str(same_tokenizer), demo_model.name_or_path) is None
    assert champion_not_comparable(str(other_tokenizer), demo_model.name_or_path) == (
        f"the champion was trained on {other_tokenizer}, whose tokenizer differs from {demo_model.name_or_path}'s: "
        "per-token losses do not compare")
    gone = champion_not_comparable(str(tmp_path / "deleted-base"), demo_model.name_or_path)
    assert gone.startswith(f"the champion's base model {tmp_path / 'deleted-base'} cannot be loaded")


@pytest.mark.parametrize(("edit", "named"), [
    ({"bos_token": None}, "bos <s> (id 1) there, none here"),  # Qwen2.5: no bos
    ({"eos_token": "<unk>"}, "eos </s> (id 2) there, <unk> (id 3) here"),  # base vs Instruct: another eos
])
def test_a_champion_whose_tokenizer_puts_other_special_tokens_around_examples_is_not_compared(
        demo_model, tmp_path, edit, named):
    # Same tokenizer.json, another bos/eos in tokenizer_config.json: every text tokenizes alike, but
    # each example is scored with another bos before it and eos after it.
    import json

    from training_core.evaluate.compare import champion_not_comparable

    other = tmp_path / "other-special-tokens"
    shutil.copytree(demo_model.name_or_path, other)
    config_file = other / "tokenizer_config.json"
    config = {k: v for k, v in {**json.loads(config_file.read_text()), **edit}.items() if v is not None}
    config_file.write_text(json.dumps(config))

    assert champion_not_comparable(demo_model.name_or_path, str(other)) == (
        f"the champion was trained on {demo_model.name_or_path}, whose tokenizer puts other special tokens around "
        f"each example than {other}'s ({named}): per-token losses do not compare")


def test_a_champion_whose_mlflow_run_was_garbage_collected_is_not_compared_and_evaluation_goes_on(
        tmp_path, demo_model, adapter_dir):
    from assets.evaluation_assets import CHAMPION_ALIAS, REGISTERED_MODEL, evaluation
    from assets.training_assets import TrainedModel
    from resources import MlflowTracker, TesseraStorage
    from tests.unit.conftest import garbage_collect_run
    from training_core.registry import ModelRegistry

    storage = TesseraStorage(home=str(tmp_path / "home"))
    mlflow_tracker = MlflowTracker(storage=storage)
    tracking = mlflow_tracker.client()
    champion_run = tracking.start_run("champion", tags={})
    tracking.log_batch(champion_run, params={"base_model": demo_model.name_or_path})
    tracking.client.log_artifacts(champion_run, str(adapter_dir), "model")
    ModelRegistry(tracking, REGISTERED_MODEL, CHAMPION_ALIAS).promote(champion_run)
    garbage_collect_run(tracking.tracking_uri, champion_run)  # the alias still points at its version
    trained_run = tracking.start_run("trained", tags={})
    dataset = write_dataset(generate_records("2026-11-01", 400), load_tokenizer(demo_model.name_or_path),
                            tmp_path / "datasets", DatasetSpec(), source_label="partition 2026-11-01")

    outputs = list(evaluation(
        dg.build_asset_context(partition_key="2026-11-01"), config=EvaluationConfig(), mlflow_tracker=mlflow_tracker,
        storage=storage, ray_cluster=None, training_dataset={"2026-11-01": dataset}, base_model=demo_model,
        lora_adapter=TrainedModel(str(adapter_dir), "lora", trained_run, demo_model.name_or_path,
                                  dataset.digest, 1.0)))

    report = next(o.value for o in outputs if isinstance(o, dg.Output))
    assert report.champion is None and report.base.examples > 0
    check = next(o for o in outputs if isinstance(o, dg.AssetCheckResult) and o.check_name == "not_worse_than_champion")
    assert check.passed is True and check.metadata["compared"].value is False
    assert check.metadata["champion_run_id"].value == champion_run
    assert check.description == (
        f"not compared: tessera-adapter version 1 (MLflow run {champion_run}), alias 'champion': its run is not in "
        "the tracking store (deleted and garbage-collected, or logged to another store), so its base model is "
        "unknown; a model that passes the other gate replaces it as champion")
    assert "eval_loss" in tracking.client.get_run(trained_run).data.metrics  # the evaluation was recorded


# --- greedy exact-match -------------------------------------------------------------------------


def _spelling_model(base_model: str, folder, prompt_last: str, response: str, tokenizer):
    """The demo model rewired into a bigram table, saved in ``folder``: the next token depends only on
    the current one, and from ``prompt_last`` it spells ``response`` then eos, each token by a narrow
    margin (logit 10, runner-up "z" 9.8) as a trained model's often is."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_model)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:  # no attention, no MLP: the residual carries the current token
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        for token in range(len(tokenizer)):
            model.model.embed_tokens.weight[token, token] = 1.0  # one-hot; RMSNorm scales it to sqrt(hidden)
        model.lm_head.weight.zero_()
        chain = tokenizer.convert_tokens_to_ids([prompt_last, *response.split(), tokenizer.eos_token])
        for current, following in zip(chain, chain[1:]):
            model.lm_head.weight[following, current] = 10.0 / hidden**0.5
            model.lm_head.weight[tokenizer.convert_tokens_to_ids("z"), current] = 9.8 / hidden**0.5
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


CHECKPOINT_GENERATION_DEFAULTS = {  # what a checkpoint's generation_config.json may hold
    "Qwen2.5-Instruct": lambda tokenizer: {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                           "repetition_penalty": 1.05},
    "no_repeat_ngram_size": lambda tokenizer: {"no_repeat_ngram_size": 1},
    "min_new_tokens": lambda tokenizer: {"min_new_tokens": 8},
    "suppress_tokens": lambda tokenizer: {"suppress_tokens": tokenizer.convert_tokens_to_ids(["d"])},  # None is "off"
}


@pytest.mark.parametrize("defaults", sorted(CHECKPOINT_GENERATION_DEFAULTS))
def test_greedy_exact_match_ignores_the_checkpoints_generation_defaults(demo_model, tmp_path, defaults):
    # The answer repeats prompt tokens ("d", "a"): a repetition penalty or n-gram ban from the
    # checkpoint's generation_config.json would turn the model's right answer into a miss.
    import json
    import warnings

    from training_core.evaluate.metrics import evaluate, load_model_for_eval

    records = [{"prompt": "encode: a d x y", "response": "d g a b"}]
    tokenizer = load_tokenizer(demo_model.name_or_path)
    folder = _spelling_model(demo_model.name_or_path, tmp_path / "model", "y", "d g a b", tokenizer)
    generation_file = folder / "generation_config.json"
    generation_file.write_text(json.dumps({**json.loads(generation_file.read_text()),
                                           **CHECKPOINT_GENERATION_DEFAULTS[defaults](tokenizer)}))
    model = load_model_for_eval(str(folder))
    checkpoint_defaults = model.generation_config.to_diff_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = evaluate(model, tokenizer, records)
    assert metrics.exact_match == 1.0
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []
    assert model.generation_config.to_diff_dict() == checkpoint_defaults  # the model is left as it was loaded


# --- empty held-out split ------------------------------------------------------------------------


def test_a_partition_with_no_eval_records_is_refused_when_the_dataset_is_written(tmp_path, demo_model):
    tokenizer = load_tokenizer(demo_model.name_or_path)
    records = generate_records("2026-11-05", 400)
    train_only = [r for r in records if not is_eval_prompt(tokenizer, r["prompt"], 0.05)][:20]
    with pytest.raises(EmptyPartitionError, match=r"partition 2026-11-05: none of its 20 records fell into the eval "
                                                  r"split \(eval_fraction=0\.05.*raise eval_fraction or add records"):
        write_dataset(train_only, tokenizer, tmp_path, DatasetSpec(), source_label="partition 2026-11-05")
    assert list(tmp_path.iterdir()) == []

    held_out = next(r for r in records if is_eval_prompt(tokenizer, r["prompt"], 0.05))
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
