"""GPU-only paths (NCCL, bf16, flash-attention 2, QLoRA via bitsandbytes). They run where a CUDA
GPU exists and skip with the reason elsewhere; CPU CI checks their config rejections instead
(tests/unit/test_bad_inputs.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from training_core.train.config import LoraSettings, TrainingConfig
from training_core.train.launcher import run_training

pytestmark = [
    pytest.mark.integration,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16, NCCL, flash-attention, QLoRA)"),
]


def _run(ray_session, demo_model, demo_dataset, tmp_path, **overrides):
    config = TrainingConfig(lora=LoraSettings(modules_to_save=["embed_tokens", "lm_head"]), max_steps=5,
                            num_workers=1, use_gpu=True, **overrides)
    config.check_hardware(gpu_available=True)
    return run_training(config, model_path=demo_model.name_or_path, train_dirs=[str(demo_dataset.train_dir)],
                        seq_len=demo_dataset.seq_len, cache_dir=str(tmp_path / "cache"), storage_path=tmp_path / "ray",
                        run_name="gpu", output_dir=tmp_path / "models")


def test_bf16_lora_on_nccl(ray_session, demo_model, demo_dataset, tmp_path):
    from training_core.train.telemetry import resolve_peak_preset

    result = _run(ray_session, demo_model, demo_dataset, tmp_path, precision="bf16")
    assert result.steps == 5 and result.telemetry["peak_memory_mb"] > 0
    if resolve_peak_preset("auto", torch.cuda.get_device_name()) != "cpu":  # an A100/H100/H200: MFU against its peak
        assert 0.0 < result.telemetry["mfu"] < 1.0 and result.telemetry["peak_flops_per_s"] > 0


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed")
def test_flash_attention_2(ray_session, demo_model, demo_dataset, tmp_path):
    result = _run(ray_session, demo_model, demo_dataset, tmp_path, precision="bf16", attention="flash_attention_2")
    assert result.loss_history[-1][1] < result.loss_history[0][1]


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
def test_qlora_4bit(ray_session, demo_model, demo_dataset, tmp_path):
    result = _run(ray_session, demo_model, demo_dataset, tmp_path, method="qlora", precision="bf16", zero_stage=2)
    assert result.steps == 5


def test_bf16_evaluation_on_the_gpu_scores_like_fp32_on_the_cpu(ray_session, demo_model, demo_dataset, tmp_path):
    from training_core.data.dataset_writer import read_eval_records
    from training_core.evaluate.compare import EvaluationJob, run_evaluation
    from training_core.evaluate.on_ray import evaluate_on_ray
    from training_core.evaluate.settings import EvalSettings

    trained = _run(ray_session, demo_model, demo_dataset, tmp_path, precision="bf16")
    records = read_eval_records(demo_dataset.path)
    on_gpu = run_evaluation(EvaluationJob(demo_model.name_or_path, trained.model_dir, records, EvalSettings("auto", "bf16")))
    on_cpu = run_evaluation(EvaluationJob(demo_model.name_or_path, trained.model_dir, records, EvalSettings("cpu")))
    assert on_gpu.settings.device == "cuda"
    assert on_gpu.trained.loss == pytest.approx(on_cpu.trained.loss, rel=0.05)  # bf16 weights: ~3 significant digits
    in_ray_task = evaluate_on_ray(EvaluationJob(demo_model.name_or_path, trained.model_dir, records,
                                                EvalSettings("auto", "bf16")), cluster_has_gpu=True)
    assert in_ray_task.settings.device == "cuda"  # the task asked Ray for the GPU and saw it
