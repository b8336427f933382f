"""Settings that passed every check and then failed, or trained nothing, only once training ran:
flash-attn with fp32 weights (transformers warns, then its kernels refuse fp32), a learning rate
above 1 (the model is destroyed and the run finishes without a word), and a GPU setting whose
package the workers lack (an ImportError, which Ray Train retried, loading the model each time)."""

from __future__ import annotations

import importlib.util

import pytest

from training_core.errors import ConfigError
from training_core.train.config import TrainingConfig, parse_training_config


def test_flash_attention_in_fp32_is_refused_with_the_config():
    with pytest.raises(ConfigError, match=r"attention='flash_attention_2' runs in bf16 only \(flash-attn has no "
                                          r"fp32 kernels\), and precision is 'fp32'; set precision='bf16', or "
                                          r"attention='sdpa'"):
        parse_training_config({"use_gpu": True, "attention": "flash_attention_2"})
    assert parse_training_config({"use_gpu": True, "attention": "flash_attention_2", "precision": "bf16"}).use_gpu


@pytest.mark.parametrize("rate", [5, 1000, 1.5])
def test_a_learning_rate_above_one_is_refused_with_the_usual_range(rate):
    with pytest.raises(ConfigError, match=rf"learning_rate: .*must be at most 1, got {rate:g}; fine-tuning a "
                                          r"pretrained model uses about 1e-5 to 1e-3 \(an exponent left off"):
        parse_training_config({"learning_rate": rate})
    assert parse_training_config({"learning_rate": 1.0}).learning_rate == 1.0


@pytest.mark.parametrize(("setting", "package", "message"), [
    ({"attention": "flash_attention_2"}, "flash_attn",
     r"^attention='flash_attention_2' \(training config\) needs the flash_attn package on every training worker, "
     r"and this one lacks it; install flash-attn, built against the workers' CUDA torch .* or set attention='sdpa'$"),
    ({"method": "qlora"}, "bitsandbytes",
     r"^method='qlora' \(training config\) needs the bitsandbytes package on every training worker, and this one "
     r"lacks it; install the gpu extra on the workers: pip install 'tessera\[gpu\]'"),
])
def test_a_gpu_setting_whose_package_the_worker_lacks_fails_without_ray_retries(setting, package, message, demo_model):
    from training_core.train.model_setup import load_base_model
    from training_core.train.repeatable_failures import REPEATABLE_ERRORS

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    config = TrainingConfig(use_gpu=True, precision="bf16", **setting)
    with pytest.raises(ConfigError, match=message) as failure:
        load_base_model(config, demo_model.name_or_path)  # what each Ray worker does first
    # Recorded by the worker; Ray's retries then stop before loading the model (test_training_runs).
    assert isinstance(failure.value, REPEATABLE_ERRORS)
