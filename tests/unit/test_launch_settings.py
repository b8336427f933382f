"""What is refused before a run does any work: settings any asset of the run would refuse (checked by
every step, so a bad evaluation setting does not wait for training), and a scheduled day whose
training window holds a day that was never materialized (the schedule skips it, naming the backfill)."""

from __future__ import annotations

from datetime import datetime, timezone

import dagster as dg
import pytest

from assets.launch_checks import _asset_configs, run_config_problems
from assets.partitions import DEMO_PARTITION
from pipelines.definitions import defs
from pipelines.graph import ASSETS
from pipelines.resources_local import local_resources


JOB = defs.resolve_job_def("train_and_promote")


def _ops(asset: str, **settings) -> dict:
    return {"ops": {asset: {"config": settings}}}


def test_every_asset_with_settings_is_checked():
    with_settings = {op for op, values in dg.validate_run_config(JOB, {})["ops"].items() if values.get("config")}
    assert with_settings == set(_asset_configs())


@pytest.mark.parametrize(("run_config", "problems"), [
    (_ops("raw_examples", records_per_partition=0),
     ["ops.raw_examples.config.records_per_partition: Input should be greater than 0, got 0"]),
    (_ops("base_model", demo_hidden_size=100),  # 4 heads of 25: rotary embeddings need an even head size
     ["ops.base_model.config.demo_hidden_size: demo_hidden_size must be a multiple of 8 (the demo model's 4 "
      "attention heads, each of an even size for rotary embeddings), got 100"]),
    (_ops("evaluation", batch_size=0, max_loss_ratio=float("nan")),
     ["ops.evaluation.config.max_loss_ratio: Input should be a finite number, got nan",
      "ops.evaluation.config.batch_size: Input should be greater than or equal to 1, got 0"]),
    (_ops("lora_adapter", precision="bf16"),  # GPU-only without use_gpu: refused before any step, not once Ray is up
     ["ops.lora_adapter.config: precision='bf16' needs a GPU; set use_gpu=True on a GPU cluster"]),
    (_ops("evaluation", device="cpu", precision="bf16"),  # a combination
     ["ops.evaluation.config: evaluation precision='bf16' needs a GPU; use device='cuda' (or 'auto' on a GPU "
      "machine) or precision='fp32'"]),
    # the training config's own checks, named by the launchpad's fields
    (_ops("lora_adapter", zero_stage=7, micro_batch_size=0, learning_rate=-1.0, lora_target_modules=[]),
     ["ops.lora_adapter.config.lora_target_modules: target_modules must be 'all-linear' or a non-empty list of "
      "module names",
      "ops.lora_adapter.config.zero_stage: zero_stage must be 0, 1, 2 or 3 (DeepSpeed ZeRO), got 7",
      "ops.lora_adapter.config.micro_batch_size: micro_batch_size must be > 0, got 0",
      "ops.lora_adapter.config.learning_rate: learning_rate must be a finite number > 0, got -1.0"]),
    (_ops("lora_adapter", offload_optimizer="cpu", zero_stage=0),
     ["ops.lora_adapter.config: offload_optimizer='cpu' needs zero_stage >= 1 (ZeRO-Offload partitions the "
      "optimizer)"]),
    (_ops("lora_adapter", max_steps=20), []),
])
def test_run_config_problems_name_each_bad_field_and_why(run_config, problems):
    assert run_config_problems(JOB, run_config) == problems


def test_a_bad_later_setting_fails_the_run_in_its_first_step_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    bad = {"ops": {"raw_examples": {"config": {"records_per_partition": 40}},
                   "lora_adapter": {"config": {"zero_stage": 7}}, "evaluation": {"config": {"batch_size": 0}}}}
    result = dg.materialize(ASSETS, partition_key=DEMO_PARTITION, resources=local_resources(), run_config=bad,
                            instance=dg.DagsterInstance.ephemeral(), raise_on_error=False)
    assert not result.success
    started = {e.step_key for e in result.all_events if e.event_type_value == "STEP_START"}
    failures = {e.step_key: e.step_failure_data.error.message
                for e in result.all_events if e.event_type_value == "STEP_FAILURE"}
    # Only the run's first steps, base_model and raw_examples (neither needs the other), started; each refused it.
    assert started == set(failures) and started <= {"base_model", "raw_examples"}
    for message in failures.values():
        assert "invalid run config, refused before this step did any work" in message
        assert "ops.lora_adapter.config.zero_stage: zero_stage must be 0, 1, 2 or 3" in message
        assert "ops.evaluation.config.batch_size: Input should be greater than or equal to 1, got 0" in message
    assert not (tmp_path / "datasets").exists() and not (tmp_path / "models").exists()  # nothing frozen or built


def _tick(instance: dg.DagsterInstance, day_after: int):
    schedule = defs.resolve_schedule_def("daily_retrain")
    # Closed after the tick: an open context would leave its instance set as the current one.
    with dg.build_schedule_context(instance=instance, repository_def=defs.get_repository_def(),
                                   scheduled_execution_time=datetime(2026, 11, day_after, 2, tzinfo=timezone.utc)
                                   ) as context:
        return schedule.evaluate_tick(context)


def _failed_before_its_cache(instance: dg.DagsterInstance, day: str) -> None:
    """A run of the day that failed before row_group_cache: the schedule does not retry it."""
    instance.report_run_failed(instance.create_run_for_job(JOB, tags={"dagster/partition": day}))


def test_the_schedule_skips_a_day_whose_window_holds_a_day_never_materialized(monkeypatch):
    monkeypatch.delenv("TESSERA_RUN_CONFIG", raising=False)
    with dg.instance_for_test() as instance:
        # The first day's window is that day alone: nothing earlier to wait for.
        (first,) = _tick(instance, 2).run_requests
        assert first.partition_key == "2026-11-01"
        _failed_before_its_cache(instance, "2026-11-01")
        assert _tick(instance, 3).skip_message == (
            "not starting train_and_promote for 2026-11-02: its training window also reads 2026-11-01, where "
            "row_group_cache was never materialized, so lora_adapter would fail. Backfill assets "
            "base_model,raw_examples,training_dataset,row_group_cache for partition 2026-11-01; a later tick then "
            "starts train_and_promote for 2026-11-02")
        instance.report_runless_asset_event(dg.AssetMaterialization("row_group_cache", partition="2026-11-01"))
        (request,) = _tick(instance, 3).run_requests
        assert request.partition_key == "2026-11-02"
        _failed_before_its_cache(instance, "2026-11-02")
        # base_model built once: the backfill needs the window assets only
        instance.report_runless_asset_event(dg.AssetMaterialization("base_model"))
        assert "Backfill assets raw_examples,training_dataset,row_group_cache for partition 2026-11-02; a later " \
               "tick then starts train_and_promote for 2026-11-03" in _tick(instance, 4).skip_message


def test_the_schedule_waits_for_an_earlier_days_run_that_is_still_going_instead_of_asking_for_a_backfill():
    with dg.instance_for_test() as instance:
        running = instance.create_run_for_job(JOB, run_id=None, tags={"dagster/partition": "2026-11-01"},
                                              status=dg.DagsterRunStatus.STARTED)
        assert _tick(instance, 3).skip_message == (
            "not starting train_and_promote for 2026-11-02: its training window also reads 2026-11-01, whose "
            f"run or backfill is still going (2026-11-01: run {running.run_id} queued or running); a later "
            "tick starts train_and_promote for 2026-11-02 once it has ended")
        instance.report_run_failed(running)  # a failed run builds nothing: the backfill is named again
        assert "Backfill assets" in _tick(instance, 3).skip_message


def test_the_skipped_ticks_backfill_names_the_schedules_run_config(tmp_path, monkeypatch):
    run_config = tmp_path / "daily_retrain.yaml"
    run_config.write_text("ops:\n  raw_examples:\n    config:\n      source: /data/exports/{partition}.jsonl\n")
    monkeypatch.setenv("TESSERA_RUN_CONFIG", str(run_config))
    with dg.instance_for_test() as instance:
        _failed_before_its_cache(instance, "2026-11-01")
        assert f"for partition 2026-11-01 with the run config in {run_config}; a later tick then starts" in _tick(
            instance, 3).skip_message
