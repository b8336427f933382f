"""Training settings refused in the driver, naming the field, before any Ray worker starts: LoRA
module names the model lacks or PEFT cannot adapt (checked on the model's skeleton, and against what
PEFT itself does with them), and seeds torch cannot take. Without these checks each failed inside
every worker, once per Ray retry."""

from __future__ import annotations

import pytest

from training_core.errors import ConfigError
from training_core.train.config import TrainingConfig, parse_training_config


def test_modules_to_save_that_the_model_lacks_are_refused(demo_model):
    from training_core.train.model_setup import apply_method, load_base_model

    config = TrainingConfig(lora={"modules_to_save": ["embed_tokenz", "lm_head"]})
    with pytest.raises(ConfigError, match=r"lora.modules_to_save \['embed_tokenz'\]: no module of that name"):
        apply_method(load_base_model(config, demo_model.name_or_path), config)
    with pytest.raises(ConfigError, match="modules_to_save names must not be blank"):
        parse_training_config({"lora": {"modules_to_save": [""]}})
    with pytest.raises(ConfigError, match="target_modules must be 'all-linear' or a non-empty list"):
        parse_training_config({"lora": {"target_modules": "  "}})
    with pytest.raises(ConfigError, match=r"target_modules \['all-linear', 'q_proj'\]: 'all-linear' stands alone"):
        parse_training_config({"lora": {"target_modules": ["all-linear", "q_proj"]}})


@pytest.mark.parametrize(("lora", "message"), [
    ({"modules_to_save": ["wte", "lm_head"]},
     r"lora.modules_to_save \['wte'\]: no module of that name in the base model \(top-level modules: \['model', "
     r"'lm_head'\]\); for a pretrained base, set it to \[\]"),
    ({"target_modules": ["q_proj", "c_attn"]},
     r"lora.target_modules \['c_attn'\]: no module of that name in the base model \(layers LoRA can wrap: .*'q_proj'"),
    ({"target_modules": "all_linear"},  # a misspelt keyword is a regular expression to PEFT
     r"lora.target_modules 'all_linear': PEFT reads a string other than 'all-linear' as a regular expression over "
     r"full module names \(such as 'model.layers.0.*'\) and this one matches none"),
    ({"target_modules": "(q_proj"}, r"lora.target_modules '\(q_proj' is neither 'all-linear' nor a valid regular"),
    ({"target_modules": ["norm"]}, r"lora.target_modules \['norm'\] selects modules LoRA cannot wrap: model.norm "
                                   r"\(LlamaRMSNorm\)"),
])
def test_lora_module_names_the_model_lacks_are_refused_before_any_worker_starts(lora, message, demo_model, tmp_path):
    import ray

    from training_core.train.launcher import run_training

    config = TrainingConfig(lora=lora, num_workers=1)
    with pytest.raises(ConfigError, match=message):
        run_training(config, model_path=demo_model.name_or_path, train_dirs=[str(_tiny_training_dir(tmp_path))],
                     seq_len=8, cache_dir=None, storage_path=tmp_path / "ray", run_name="r", output_dir=tmp_path / "out")
    assert not ray.is_initialized()  # refused in the driver: no Ray, no worker, no retry


def test_seed_is_refused_where_a_workers_seed_would_overflow_torch():
    import torch

    from training_core.train.config import MAX_SEED

    for seed in (2**63, 2**64 - 1):  # 2**64 - 1 passed before, and failed on rank 1 in every retry
        with pytest.raises(ConfigError, match=rf"invalid training config: seed: .*seed must be at most 2\*\*63 - 1 "
                                              rf"= {MAX_SEED} \(each worker seeds torch with seed \+ rank.*got {seed}"):
            parse_training_config({"seed": seed})
    assert parse_training_config({"seed": MAX_SEED}).seed == MAX_SEED
    with torch.random.fork_rng():
        torch.manual_seed(MAX_SEED + 4095)  # what rank 4095 does
    # NumPy takes the data seed in a list of any size, so any non-negative one is fine.
    assert parse_training_config({"data_seed": 2**64}).data_seed == 2**64


# LoRA settings each checked in the driver and what PEFT does with them in a worker (None: trains).
_LORA_IN_DRIVER_AND_WORKER = [
    ({"target_modules": ["norm"]}, r"selects modules LoRA cannot wrap: model.norm \(LlamaRMSNorm\); PEFT's LoRA "
     r"wraps only .* \(in this model: \['down_proj', 'embed_tokens', .*'v_proj'\]\)", "is not supported"),
    ({"target_modules": ["layers"]}, r"cannot wrap: model.layers \(ModuleList\);", "is not supported"),
    ({"target_modules": ["model"]}, r"cannot wrap: model \(LlamaModel\);", "is not supported"),
    ({"target_modules": ".*"}, r"'.\*' selects modules LoRA cannot wrap: model \(LlamaModel\), model.layers "
     r"\(ModuleList\), model.layers.0 \(LlamaDecoderLayer\) and \d+ more", "is not supported"),
    ({"target_modules": ["embed_tokens"], "modules_to_save": ["embed_tokens", "lm_head"]},
     r"lora.target_modules \['embed_tokens'\]: every module it selects \(model.embed_tokens \(Embedding\)\) is in "
     r"or inside lora.modules_to_save", "No modules were targeted"),
    ({"target_modules": "all-linear", "modules_to_save": ["model"]}, r"every module it selects .* and \d+ more\) "
     r"is in or inside lora.modules_to_save \['model'\]", "No modules were targeted"),
    ({"target_modules": ["lm_head"], "modules_to_save": ["layers"]}, r"lora.modules_to_save \['layers'\] picks "
     r"containers, .* PEFT cannot train them in full: model.layers \(ModuleList\);", "cannot be applied to modules"),
    ({"target_modules": "all-linear", "modules_to_save": ["embed_tokens", "lm_head"]}, None, None),
    ({"target_modules": ["embed_tokens", "q_proj"]}, None, None),  # an embedding is a LoRA layer too
    ({"target_modules": r"model\.layers\.\d+\.mlp\..*"}, r"cannot wrap: model.layers.0.mlp.act_fn \(SiLUActivation\), "
     r"model.layers.1.mlp.act_fn \(SiLUActivation\);", "is not supported"),
    ({"target_modules": r"model\.layers\.\d+\.mlp\.\w+_proj", "modules_to_save": ["norm"]}, None, None),
    ({"target_modules": ["q_proj"], "modules_to_save": ["self_attn"]}, r"every module it selects", "No modules"),
]


@pytest.mark.parametrize(("lora", "message", "peft_error"), _LORA_IN_DRIVER_AND_WORKER)
def test_lora_modules_that_peft_cannot_adapt_are_refused_in_the_driver(lora, message, peft_error, demo_model):
    """The driver's check (on the meta skeleton) refuses exactly what PEFT would fail on in each worker."""
    import torch

    from training_core.base_model import load_model_config
    from training_core.train.model_setup import apply_method, check_model_before_start, load_base_model

    config = TrainingConfig(lora=lora)
    if message is None:
        check_model_before_start(config, load_model_config(demo_model.name_or_path))
    else:
        with pytest.raises(ConfigError, match=message) as refused:
            check_model_before_start(config, load_model_config(demo_model.name_or_path))
        assert "\n" not in str(refused.value)
    model = load_base_model(config, demo_model.name_or_path)
    with torch.random.fork_rng():
        if peft_error is None:
            model = apply_method(model, config)
            model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
            return
        from peft import LoraConfig, get_peft_model

        with pytest.raises(Exception, match=peft_error):  # what each worker would fail with, once per retry
            peft = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, **lora)
            get_peft_model(model, peft)(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]]))


def test_a_module_to_save_that_peft_would_also_adapt_is_refused():
    """PEFT picks modules_to_save by the end of a name: 'proj' also picks 'q_proj', which LoRA has wrapped by
    then, and PEFT fails (in every worker) on a LoRA layer it should copy."""
    import torch

    from training_core.train.model_setup import check_module_names

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.q_proj = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    model = torch.nn.Sequential()
    model.add_module("block", Block())
    config = TrainingConfig(lora={"target_modules": ["q_proj"], "modules_to_save": ["proj"]})
    with pytest.raises(ConfigError, match=r"lora.modules_to_save \['proj'\] also picks block.q_proj \(Linear\) "
                                          r"\(PEFT matches the end of a name, not a whole part\)"):
        check_module_names(config, model)
    check_module_names(TrainingConfig(lora={"target_modules": ["q_proj"], "modules_to_save": ["block.proj"]}), model)


def _tiny_training_dir(tmp_path):
    """A folder the driver's data checks accept (token lists, enough rows for one micro batch, each row's
    trained tokens ending in the demo tokenizer's eos, id 2)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "train"
    folder.mkdir()
    tokens = pa.array([[1] * 7 + [2]] * 16, type=pa.list_(pa.int32()))
    pq.write_table(pa.table({"input_ids": tokens, "labels": tokens}), folder / "part-0.parquet")
    return folder


@pytest.mark.parametrize("retired", [{"cache_size_limit_bytes": 1 << 30}, {"report_every_steps": 10}])
def test_retired_settings_of_recorded_configs_are_read_and_refuse_no_relaunch(retired):
    """cache_size_limit_bytes and report_every_steps were recorded in every run's config but never
    used (the loader reads the cache under the quota it was warmed with; every step's loss is
    reported with each checkpoint): gone from the config, still read in configs recorded with them
    (MLflow's training_config.json, a checkpoint's progress.json)."""
    from training_core.train.checkpointing import TrainingProgress, settings_changed_since
    from training_core.train.config import config_values_digest

    assert not retired.keys() & TrainingConfig.model_fields.keys()
    recorded = {**TrainingConfig(learning_rate=0.01).model_dump(mode="json"), **retired}
    config = parse_training_config(recorded)
    assert config == TrainingConfig(learning_rate=0.01)
    # A relaunch of a run folder started by the code that recorded it, with the same settings, resumes.
    started = TrainingProgress(config_digest=config_values_digest(recorded), config=recorded, base_model="/m",
                               training_data=["/d"])
    assert config.digest() != started.config_digest  # the digest of a config recorded from now on differs
    assert settings_changed_since(started, config, "/m", ["/d"]) == []
    assert settings_changed_since(started, TrainingConfig(learning_rate=0.02), "/m", ["/d"]) == [
        "learning_rate: 0.01 → 0.02"]


def test_lora_settings_leave_a_full_parameter_config_and_its_digest_alone():
    """method 'full' trains no adapter: LoRA settings left over from a LoRA launch must not change the
    config digest (which names the Ray run, so a changed one restarts from step 0 and reuses nothing)."""
    full = TrainingConfig(method="full")
    leftover = parse_training_config({"method": "full", "lora": {"r": 4, "modules_to_save": ["embed_tokens"]}})
    assert leftover == full and leftover.digest() == full.digest()
    # under LoRA they are the run's settings
    assert parse_training_config({"lora": {"r": 4}}).digest() != TrainingConfig().digest()
