"""Jobs and schedules over the asset graph."""

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import dagster as dg
import yaml
from dagster._core.execution.backfill import BulkActionsFilter, BulkActionStatus

from assets.partitions import DAILY, earlier_window_days, later_window_days, materialized_for_day
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


# Retraining, one day at a time. A day's export has landed by EXPORT_LANDED_HOUR:00 UTC the day after
# (the partitions' timezone); from then the schedule ticks every hour, and each tick starts at most one
# run: the oldest day still to train whose training window is built, among the last CATCH_UP_DAYS closed
# days after the first day ever trained or tried (the last one only where no day ever was; `tessera demo`'s
# runs do not count). A tick that cannot start it (an earlier day of its window still being built, the
# daemon down over a tick, a backfill of the day in progress) loses nothing: a later tick starts it.
# Unchanged inputs reuse the earlier training run instead of retraining.
EXPORT_LANDED_HOUR = 2
CATCH_UP_DAYS = 7
# Tags the runs of `tessera demo`: the schedule does not take them for the deployment's first retraining.
DEMO_RUN_TAG = "tessera/demo"


@dataclass(frozen=True)
class OurDailyAssets:
    """This code location's daily asset keys and its repository (whose jobs a run without a selection ran)."""
    keys: frozenset[dg.AssetKey]
    repository: dg.RepositoryDefinition

    @classmethod
    def of(cls, repository: dg.RepositoryDefinition) -> "OurDailyAssets":
        graph = repository.asset_graph
        return cls(frozenset(key for key in graph.get_all_asset_keys() if graph.get(key).partitions_def == DAILY),
                   repository)


def daily_retrain(embedded_defaults_allowed: bool = True) -> dg.ScheduleDefinition:
    """The `daily_retrain` schedule. The local code location may run it on the embedded defaults
    (the demo); the Kubernetes one passes False, so an unset TESSERA_RUN_CONFIG fails the tick."""
    unset = "the embedded demo defaults" if embedded_defaults_allowed else "each tick fails, naming it"

    @dg.schedule(
        job=demo_job, name="daily_retrain", cron_schedule=f"0 {EXPORT_LANDED_HOUR}-23 * * *",
        execution_timezone="UTC",
        description=f"hourly from {EXPORT_LANDED_HOUR:02}:00 to 23:00 UTC, train the oldest of the last "
                    f"{CATCH_UP_DAYS} closed days not yet trained (or tried) whose training window is built and that "
                    f"no run or backfill of it or of a neighbour in the window is building (no day ever trained: the "
                    f"last one only), with the run config in "
                    f"${RUN_CONFIG_ENV} (unset: {unset})",
    )
    def daily_retrain_schedule(context: dg.ScheduleEvaluationContext):
        # The tick's own time, never the clock: the daemon evaluates missed ticks late, when it catches up.
        landed_by = context.scheduled_execution_time - timedelta(hours=EXPORT_LANDED_HOUR)
        closed_days = DAILY.get_partition_keys(current_time=landed_by)
        if not closed_days:
            return dg.SkipReason("no day has closed since the first partition")
        # A bad or missing file fails the tick, naming it, before any run starts.
        run_config = scheduled_run_config(embedded_defaults_allowed)
        run_config_file = os.environ[RUN_CONFIG_ENV].strip() if run_config else None
        # The recent days not trained or tried after the first day that ever was (after a pause, or with days
        # waiting behind a failed one that has left the range: all of them, so a blocked day keeps its turn);
        # on a fresh deployment (no day ever was) the day that just closed only: earlier days may never be
        # meant to train.
        recent = closed_days[-CATCH_UP_DAYS:]
        first_tried = _first_day_trained_or_tried(context.instance)
        since = len(recent) - 1 if first_tried is None else next(
            (index for index, day in enumerate(recent) if day >= first_tried), len(recent))
        tried = [_trained_or_tried(context.instance, day) for day in recent[since:]]
        candidates = [day for day, done in zip(recent[since:], tried) if not done]
        ours = OurDailyAssets.of(context.repository_def)
        if not candidates:
            if going := _runs_in_progress(context.instance, recent[since:], ours):
                return dg.SkipReason("nothing new to start: " + "; ".join(
                    f"run {run_id} of {day} is still queued or running" for day, run_id in sorted(going.items())))
            return dg.SkipReason(
                f"nothing to start: each closed day from {recent[min(since, len(recent) - 1)]} to {recent[-1]} has "
                "lora_adapter materialized "
                f"or a run of {demo_job.name} (a day whose run failed is not retried: relaunch it by hand)")
        backfilled = _days_in_unfinished_backfills(context.instance, ours)
        oldest_blocked = None
        for day in candidates:
            # The run materializes its own day only; lora_adapter also reads the window's earlier days.
            blocked = _why_not_ready(context.instance, day, backfilled, ours, run_config_file,
                                     _last_chance(first_tried is None, day == recent[0]))
            if blocked is None:
                if oldest_blocked:
                    context.log.info(f"starting {demo_job.name} for {day}; older days wait: {oldest_blocked}")
                tags = {"tessera/run_config": run_config_file} if run_config_file else {}
                return dg.RunRequest(run_key=day, partition_key=day, run_config=run_config, tags=tags)
            # The oldest blocked day's window days are no candidates, so its reason says what to do.
            oldest_blocked = oldest_blocked or blocked
        waiting = f". Days after it wait their turn: {', '.join(candidates[1:])}" if len(candidates) > 1 else ""
        return dg.SkipReason(oldest_blocked + waiting)

    return daily_retrain_schedule


def _trained_or_tried(instance: dg.DagsterInstance, day: str) -> bool:
    """Whether `day` has a lora_adapter, or ever had a run of the job, whatever its status: a failed day
    is relaunched by an operator, since failing again every hour would loop."""
    return materialized_for_day(instance, "lora_adapter", day) or bool(instance.get_runs(
        filters=dg.RunsFilter(job_name=demo_job.name, tags={"dagster/partition": day}), limit=1))


def _first_day_trained_or_tried(instance: dg.DagsterInstance) -> str | None:
    """The first day that ever had a lora_adapter or a run of the job: retraining started then. None: never.
    `tessera demo`'s runs (DEMO_RUN_TAG) do not count: a demo tried first on the deployment's instance would
    make every recent day look left behind."""
    first_run_day = _first_run_day(instance)
    for day in sorted(instance.get_materialized_partitions(dg.AssetKey("lora_adapter"))):
        if first_run_day is not None and day >= first_run_day:
            break
        if not _trained_by_the_demo(instance, day):
            return day
    return first_run_day


def _first_run_day(instance: dg.DagsterInstance) -> str | None:
    """The first day a run of the job that was not `tessera demo`'s was for. Reads Dagster's index of runs by
    partition (a row a day), not every run: a year-old instance's ~10 000 runs took seconds each hourly tick."""
    days = {data.partition for data in instance.get_run_partition_data(dg.RunsFilter(job_name=demo_job.name))}
    for day in sorted(days):  # only the demo's day has runs of the demo alone
        runs = instance.get_runs(filters=dg.RunsFilter(job_name=demo_job.name, tags={"dagster/partition": day}))
        if any(DEMO_RUN_TAG not in run.tags for run in runs):
            return day
    return None


def _trained_by_the_demo(instance: dg.DagsterInstance, day: str) -> bool:
    latest = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("lora_adapter"), asset_partitions=[day]), limit=1).records
    run = instance.get_run_by_id(latest[0].run_id) if latest and latest[0].run_id else None
    return run is not None and DEMO_RUN_TAG in run.tags


def _days_in_unfinished_backfills(instance: dg.DagsterInstance, ours: OurDailyAssets) -> dict[str, str]:
    """{day: id of a backfill not yet finished that targets it}, counting this code location's daily
    assets and jobs only: an instance may serve other code locations, whose backfills build other data.
    Between the runs of an asset backfill (one per stage of the graph) no run of the day is queued, yet
    the backfill builds it."""
    targeted = {}
    for backfill in instance.get_backfills(filters=BulkActionsFilter(statuses=[BulkActionStatus.REQUESTED])):
        if backfill.is_asset_backfill:
            if not ours.keys & set(backfill.asset_selection or ()):
                continue  # another code location's assets: its stored target cannot even be read with ours
            target = backfill.get_asset_backfill_data(ours.repository.asset_graph).target_subset
            days = {day for key, subset in target.partitions_subsets_by_asset_key.items() if key in ours.keys
                    for day in subset.get_partition_keys()}
        elif backfill.job_name == demo_job.name:  # a job's backfill: one run per partition named
            days = set(backfill.partition_names or ())
        else:
            continue
        for day in days:
            targeted.setdefault(day, backfill.backfill_id)
    return targeted


def _runs_in_progress(instance: dg.DagsterInstance, days: list[str], ours: OurDailyAssets) -> dict[str, str]:
    """{day: id of a run of that partition that is queued or running} for the days that have one. An instance
    may serve other code locations: a run that selects assets, none of them ours, or no assets but a job this
    code location lacks, builds other data of that day."""
    unfinished = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
                  dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]  # a canceling run still writes
    building = {}
    for day in days:
        for run in instance.get_runs(filters=dg.RunsFilter(tags={"dagster/partition": day}, statuses=unfinished)):
            if (ours.keys & run.asset_selection if run.asset_selection is not None
                    else ours.repository.has_job(run.job_name)):
                building[day] = run.run_id
                break
    return building



# What a training window reads from an earlier day: its warmed cache (and the dataset behind it).
WINDOW_DAY_ASSETS = ("raw_examples", "training_dataset", "row_group_cache")


def _why_not_ready(instance: dg.DagsterInstance, day: str, backfilled: dict[str, str], ours: OurDailyAssets,
                   run_config_file: str | None, last_chance: str) -> str | None:
    """Why a run for `day` cannot start now, or None. Another run of the day itself, or a backfill that
    targets it, would write the same partitions at once; a later day whose window reads `day` and is being
    built would train beside it on the data it rewrites, and be promoted before it. An earlier day of its
    training window that never had row_group_cache materialized (a fresh deployment, a day whose run failed)
    would fail lora_adapter after every step before had run: the reason names the backfill to launch, or
    what is building it."""
    earlier_days = earlier_window_days(day)  # the run materializes its own day only
    if own := _runs_in_progress(instance, [day], ours):
        return (f"not starting {demo_job.name} for {day}: run {own[day]} of that day is still queued or running; "
                f"a later tick reconsiders {day} once it has ended")
    if day in backfilled:
        return (f"not starting {demo_job.name} for {day}: backfill {backfilled[day]} targets that day and has not "
                f"finished; a later tick reconsiders {day} once it has")
    # A run or a backfill of an earlier day of the window is still going: wait for it to end, not only for
    # its row_group_cache (built mid-run, before its training): two trainings at once would each hold the
    # workers, where no pool limit serialises them (Kubernetes), and their promotions race.
    if building := _going(instance, earlier_days, backfilled, ours):
        several = len(building) > 1
        return (
            f"not starting {demo_job.name} for {day}: its training window also reads {', '.join(sorted(building))}, "
            f"whose {'runs or backfills are' if several else 'run or backfill is'} still going "
            f"({'; '.join(f'{d}: {building[d]}' for d in sorted(building))}); a later tick starts {demo_job.name} "
            f"for {day} once {'they have' if several else 'it has'} ended"
        )
    missing = [earlier for earlier in earlier_days if not materialized_for_day(instance, "row_group_cache", earlier)]
    if missing:
        # The backfill's training_dataset reads base_model: include it where no run has built it yet.
        selection = ([] if instance.fetch_materializations(dg.AssetKey("base_model"), limit=1).records
                     else ["base_model"]) + list(WINDOW_DAY_ASSETS)
        with_config = f" with the run config in {run_config_file}" if run_config_file else ""
        return (
            f"not starting {demo_job.name} for {day}: its training window also reads {', '.join(missing)}, where "
            f"row_group_cache was never materialized, so lora_adapter would fail. Backfill assets "
            f"{','.join(selection)} for partition{'s' if len(missing) > 1 else ''} {', '.join(missing)}{with_config}; "
            f"a later tick then starts {demo_job.name} for {day}{last_chance}"
        )
    if later := _going(instance, later_window_days(day), backfilled, ours):
        several, what = len(later) > 1, "; ".join(f"{d}: {later[d]}" for d in sorted(later))
        return (
            f"not starting {demo_job.name} for {day}: {', '.join(sorted(later))}, whose training window reads "
            f"{day}, {'are' if several else 'is'} being built ({what}); a later tick starts {demo_job.name} "
            f"for {day} once {'they have' if several else 'it has'} ended"
        )
    return None


def _last_chance(fresh_deployment: bool, oldest_considered: bool) -> str:
    """When the day is considered for the last time today, until when the advice to backfill holds."""
    if fresh_deployment:
        why = "no day has trained yet: each day's ticks consider the day that just closed only"
    elif oldest_considered:
        why = f"from then on it is no longer among the last {CATCH_UP_DAYS} closed days"
    else:
        return ""
    return f" if the backfill ends before {EXPORT_LANDED_HOUR:02}:00 UTC tomorrow ({why})"


def _going(instance: dg.DagsterInstance, days: list[str], backfilled: dict[str, str],
           ours: OurDailyAssets) -> dict[str, str]:
    """{day: the run or backfill of it still going} for those of `days` that have one."""
    going = {day: f"run {run_id} queued or running" for day, run_id in _runs_in_progress(instance, days, ours).items()}
    going.update({day: f"backfill {backfilled[day]} not finished" for day in days
                  if day in backfilled and day not in going})
    return going
