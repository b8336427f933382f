"""Jobs and schedules over the asset graph."""

import os
from pathlib import Path

import dagster as dg
import yaml

from assets.partitions import DAILY, TRAINING_WINDOW_DAYS
from training_core.errors import ConfigError

# The whole graph for one day: what `tessera demo`, a UI launch and the schedule materialize.
demo_job = dg.define_asset_job(
    "train_and_promote",
    selection=dg.AssetSelection.all(),
    partitions_def=DAILY,
    description="raw_examples → training_dataset → row_group_cache → lora_adapter → evaluation → promoted_model",
)

# The run config of scheduled runs: a YAML file shaped like the launchpad's (`ops: {raw_examples:
# {config: {source: …}}, base_model: …, lora_adapter: …}`). Without it a scheduled run would use
# the embedded defaults: the demo's generated data and demo base model.
RUN_CONFIG_ENV = "TESSERA_RUN_CONFIG"


def scheduled_run_config(embedded_defaults_allowed: bool = True) -> dict:
    """The run config named by TESSERA_RUN_CONFIG, read at each tick (edits apply to the next run).
    Unset: {} (the embedded demo defaults) where `embedded_defaults_allowed`, else a ConfigError:
    in a production code location a forgotten variable must not retrain on the demo's data."""
    path = os.environ.get(RUN_CONFIG_ENV, "").strip()
    if not path:
        if embedded_defaults_allowed:
            return {}
        raise ConfigError(f"{RUN_CONFIG_ENV} is not set: this code location does not retrain on the embedded "
                          "demo defaults; point it at a run config YAML file (docs/scaling_out.md, "
                          "\"Scheduled retraining\")")
    try:
        values = yaml.safe_load(Path(path).expanduser().read_text())
    except OSError as error:
        raise ConfigError(f"{RUN_CONFIG_ENV}={path}: cannot read it ({error.strerror or error})") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{RUN_CONFIG_ENV}={path}: not valid YAML ({error})") from None
    if not isinstance(values, dict) or not set(values) <= {"ops", "resources", "execution", "loggers"}:
        raise ConfigError(f"{RUN_CONFIG_ENV}={path}: expected Dagster run config, a mapping with 'ops' (and "
                          f"optionally 'resources'), got {type(values).__name__ if not isinstance(values, dict) else sorted(values)}")
    if not embedded_defaults_allowed and (defaulted := _settings_left_on_the_demo(values)):
        raise ConfigError(f"{RUN_CONFIG_ENV}={path}: {' and '.join(defaulted)} must name your own data and model: "
                          "this code location does not retrain on the embedded demo defaults")
    return values


# The settings whose embedded default is the demo's generated data or tiny model.
DEMO_DEFAULTED_SETTINGS = (("raw_examples", "source"), ("base_model", "name_or_path"))


def _settings_left_on_the_demo(run_config: dict) -> list[str]:
    """`ops.<asset>.config.<field>` paths a run config leaves unset or sets to 'demo'."""
    left = []
    for asset, field in DEMO_DEFAULTED_SETTINGS:
        value = run_config
        for key in ("ops", asset, "config", field):
            value = value.get(key) if isinstance(value, dict) else None
        if value is None or value == "demo":
            left.append(f"ops.{asset}.config.{field}")
    return left


# Daily retraining on the day that just closed, at RETRAIN_HOUR:RETRAIN_MINUTE UTC (the partitions'
# timezone). Unchanged inputs reuse the earlier training run instead of retraining.
RETRAIN_HOUR, RETRAIN_MINUTE = 2, 0


def daily_retrain(embedded_defaults_allowed: bool = True) -> dg.ScheduleDefinition:
    """The `daily_retrain` schedule. The local code location may run it on the embedded defaults
    (the demo); the Kubernetes one passes False, so an unset TESSERA_RUN_CONFIG fails the tick."""
    unset = "the embedded demo defaults" if embedded_defaults_allowed else "each tick fails, naming it"

    @dg.schedule(
        job=demo_job, name="daily_retrain", cron_schedule=f"{RETRAIN_MINUTE} {RETRAIN_HOUR} * * *",
        execution_timezone="UTC",
        description=f"retrain on yesterday's partition every day at 02:00 UTC, with the run config in "
                    f"${RUN_CONFIG_ENV} (unset: {unset})",
    )
    def daily_retrain_schedule(context: dg.ScheduleEvaluationContext):
        closed_days = DAILY.get_partition_keys(current_time=context.scheduled_execution_time)
        if not closed_days:
            return dg.SkipReason("no day has closed since the first partition")
        day = closed_days[-1]
        # A bad or missing file fails the tick, naming it, before any run starts.
        run_config = scheduled_run_config(embedded_defaults_allowed)
        run_config_file = os.environ[RUN_CONFIG_ENV].strip() if run_config else None
        # The run materializes its own day only; lora_adapter also reads the window's earlier days.
        if skip := _skip_unless_window_materialized(context.instance, day, closed_days[-TRAINING_WINDOW_DAYS:-1],
                                                    run_config_file):
            return skip
        tags = {"tessera/run_config": run_config_file} if run_config_file else {}
        return dg.RunRequest(run_key=day, partition_key=day, run_config=run_config, tags=tags)

    return daily_retrain_schedule


def _runs_in_progress(instance: dg.DagsterInstance, days: list[str]) -> dict[str, str]:
    """{day: id of a run of that partition that is queued or running} for the days that have one."""
    unfinished = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
                  dg.DagsterRunStatus.STARTED]
    building = {}
    for day in days:
        runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/partition": day}, statuses=unfinished), limit=1)
        if runs:
            building[day] = runs[0].run_id
    return building


# What a training window reads from an earlier day: its warmed cache (and the dataset behind it).
WINDOW_DAY_ASSETS = ("raw_examples", "training_dataset", "row_group_cache")


def _skip_unless_window_materialized(instance: dg.DagsterInstance, day: str, earlier_days: list[str],
                                     run_config_file: str | None) -> dg.SkipReason | None:
    """A SkipReason naming the backfill to launch when an earlier day of `day`'s training window never
    had row_group_cache materialized (a fresh deployment, a day whose run failed): lora_adapter would
    fail on it after every step before had run."""
    missing = [earlier for earlier in earlier_days if not instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("row_group_cache"), asset_partitions=[earlier]), limit=1).records]
    if not missing:
        return None
    if building := _runs_in_progress(instance, missing):  # a day's run queued or running: not a backfill to launch
        return dg.SkipReason(
            f"not starting train_and_promote for {day}: its training window also reads "
            f"{', '.join(sorted(building))}, whose row_group_cache run{'s are' if len(building) > 1 else ' is'} still "
            f"queued or running ({', '.join(f'{d}: run {building[d]}' for d in sorted(building))}); launch "
            f"train_and_promote for {day} once {'they have' if len(building) > 1 else 'it has'} succeeded"
        )
    # The backfill's training_dataset reads base_model: include it where no run has built it yet.
    selection = ([] if instance.fetch_materializations(dg.AssetKey("base_model"), limit=1).records
                 else ["base_model"]) + list(WINDOW_DAY_ASSETS)
    with_config = f" with the run config in {run_config_file}" if run_config_file else ""
    return dg.SkipReason(
        f"not starting train_and_promote for {day}: its training window also reads {', '.join(missing)}, where "
        f"row_group_cache was never materialized, so lora_adapter would fail. Backfill assets {','.join(selection)} "
        f"for partition{'s' if len(missing) > 1 else ''} {', '.join(missing)}{with_config}, then launch "
        f"train_and_promote for {day}"
    )
