"""Every step checks the settings of every asset in its run before it does any work.

Dagster checks only types and unknown fields at launch; ranges and combinations (a batch size of 0,
ZeRO stage 7, bf16 evaluation on the CPU) are checked when an asset's step builds its config, which
for evaluation is after training finished. So each step builds every asset's config from the run
config as that asset's step will, and refuses the run naming every bad `ops.<asset>.config.<field>`.
Evaluation in the step's own process (not on_ray_cluster) is checked against the machine the check
runs on: bf16 or device 'cuda' without a GPU is refused there too."""

from __future__ import annotations

from collections.abc import Callable

import dagster as dg
from pydantic import ValidationError

from assets.partitions import DAILY, PARTITION_TAGS, day_that_is_not_a_partition
from training_core.errors import ConfigError


def refuse_invalid_run_config(context: dg.AssetExecutionContext) -> None:
    """Raise a dg.Failure naming the daily assets of a run launched for no day, or a day the run was
    launched for that is no partition, else every invalid asset setting of this run; call first in each asset."""
    try:
        job_def, run_config = context.job_def, context.run.run_config
    except dg.DagsterError:  # invoked directly (`asset(build_asset_context(), ...)`): no run, no other assets
        return
    if no_day := daily_assets_run_for_no_day(job_def, context.run.tags):
        raise dg.Failure(f"run refused before this step did any work: {no_day}")
    if not_a_partition := day_that_is_not_a_partition(context.run.tags):
        raise dg.Failure(f"run refused before this step did any work: {not_a_partition}")
    if problems := run_config_problems(job_def, run_config):
        raise dg.Failure(f"invalid run config, refused before this step did any work: {'; '.join(problems)}")


def daily_assets_run_for_no_day(job_def: dg.JobDefinition, run_tags: dict[str, str]) -> str | None:
    """Why a run with daily assets but no partition tag is refused, or None. Launched so (the Launchpad
    with no day picked, `dagster job execute -j train_and_promote` without --tags), each daily asset failed
    on Dagster's "Cannot access partition_key for a non-partitioned run", after the unpartitioned
    base_model was written. Every step of the run refuses it, base_model's too; a daily asset whose
    upstream is daily fails in Dagster's input loading before its step runs any of our code."""
    if any(tag in run_tags for tag in PARTITION_TAGS):
        return None
    asset_layer = job_def.asset_layer
    daily = [key.to_user_string() for key in asset_layer.asset_graph.toposorted_asset_keys
             if key in asset_layer.selected_asset_keys and asset_layer.get(key).partitions_def is not None]
    if not daily:  # base_model alone
        return None
    # Dagster names a run of assets picked in the UI or by `dagster asset materialize` __ASSET_JOB.
    launch = f"launch {job_def.name}" if not job_def.name.startswith("__") else f"materialize {', '.join(daily)}"
    day = DAILY.get_last_partition_key() or DAILY.get_first_partition_key()
    return (f"{', '.join(daily)} {'is' if len(daily) == 1 else 'are'} partitioned by day and this run names no day: "
            f"{launch} for one day (the last partition is {day}; pick it in the Launchpad, or pass "
            f"`--partition {day}` to `dagster asset materialize`, `--tags '{{\"dagster/partition\": \"{day}\"}}'` "
            "to `dagster job execute`), or launch a backfill over a range of days")


def run_config_problems(job_def: dg.JobDefinition, run_config: dict) -> list[str]:
    """`ops.<asset>.config[.<field>]: why` for each setting the assets' steps would refuse."""
    # Resolved as Dagster resolves it for each step: defaults filled in, {env: VAR} values read.
    ops = dg.validate_run_config(job_def, run_config).get("ops", {})
    return [problem for asset, (config_class, combination_check) in _asset_configs().items() if asset in ops
            for problem in _problems(asset, ops[asset].get("config") or {}, config_class, combination_check)]


def _asset_configs() -> dict[str, tuple[type[dg.Config], Callable | None]]:
    """Each asset's Config class and the method that checks its fields together (None: no such method)."""
    # Imported when called: the asset modules import this one.
    from assets.data_assets import RawExamplesConfig, TrainingDatasetConfig
    from assets.evaluation_assets import EvaluationConfig, PromotionConfig
    from assets.model_assets import BaseModelConfig
    from assets.training_assets import TrainingRunConfig

    return {
        "raw_examples": (RawExamplesConfig, None),
        "training_dataset": (TrainingDatasetConfig, None),
        "base_model": (BaseModelConfig, None),
        "lora_adapter": (TrainingRunConfig, TrainingRunConfig.training_config),  # the training config's checks
        "evaluation": (EvaluationConfig, EvaluationConfig.settings_this_machine_can_run),
        "promoted_model": (PromotionConfig, None),
    }


def _problems(asset: str, values: dict, config_class: type[dg.Config], combination_check: Callable | None) -> list[str]:
    prefix = f"ops.{asset}.config"
    try:
        config = config_class(**values)
    except ValidationError as error:
        return [_describe(prefix, config_class, error_detail) for error_detail in error.errors()]
    if combination_check is None:
        return []
    try:
        combination_check(config)
    except ConfigError as error:
        if isinstance(error.__cause__, ValidationError):  # the training config's own fields
            return [_describe(prefix, config_class, detail) for detail in error.__cause__.errors()]
        return [f"{prefix}: {error}"]
    return []


def _describe(prefix: str, config_class: type[dg.Config], detail: dict) -> str:
    """`ops.<asset>.config.<field>: why`. A nested location (the training config's lora.r) names the
    launchpad field it comes from (lora_r); one that names no field (a combination) names the config."""
    loc = [str(part) for part in detail["loc"]]
    fields = config_class.model_fields
    field = next((name for name in ("_".join(loc), loc[0] if loc else "") if name in fields), None)
    message = detail["msg"].removeprefix("Value error, ")
    if detail["type"] != "value_error":  # pydantic's own messages do not say what they got
        message += f", got {detail['input']!r}"
    return f"{prefix}.{field}: {message}" if field else f"{prefix}: {message}"
