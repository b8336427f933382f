"""Where Dagster keeps asset values between steps: its pickle store, written atomically.

Dagster's filesystem IO manager opens an asset's file with "wb" and pickles into it, so a process
killed mid-write leaves the last *recorded* materialization's file empty or holding another value:
a later run of downstream assets alone then fails to unpickle it, or loads a value its lineage
does not name. Here each value goes to a temporary file next to it, renamed over the old one.
"""

import dataclasses
import os
import uuid

import dagster as dg
from dagster._check import CheckError
from dagster._core.storage.fs_io_manager import PickledObjectFilesystemIOManager
from dagster._core.storage.tags import PARTITION_NAME_TAG

from assets.partitions import materialized_for_day
from training_core.storage import flush_file, sync_directory


class AtomicPickleIOManager(PickledObjectFilesystemIOManager):
    def dump_to_path(self, context: dg.OutputContext, obj, path) -> None:
        if getattr(path, "protocol", "") not in ("", "file", "local"):
            super().dump_to_path(context, obj, path)  # object stores write whole objects anyway
            return
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            super().dump_to_path(context, obj, temporary)
            flush_file(temporary)  # the rename must not reach the disk before the bytes do
            os.replace(temporary, path)
            sync_directory(path.parent)
        finally:
            if temporary.exists():
                temporary.unlink()


    def _load_partition_from_path(self, context: dg.InputContext, partition_key: str, path, backcompat_path=None):
        try:
            value = super()._load_partition_from_path(context, partition_key, path, backcompat_path)
        except FileNotFoundError as error:  # a day inside a training window was never materialized
            never_built = _never_materialized(context, f"partition {partition_key}", path, partition_key)
            raise FileNotFoundError(never_built) from error
        except (AttributeError, ImportError) as error:  # pickled class renamed or moved since
            raise StaleValueError(_stale(context, f"partition {partition_key}", path, str(error))) from error
        return _current(context, value, f"partition {partition_key}", path)

    def _load_single_input(self, path, context: dg.InputContext):
        try:
            value = super()._load_single_input(path, context)
        except FileNotFoundError as error:
            raise FileNotFoundError(_never_materialized(context, "", path)) from error
        except (AttributeError, ImportError) as error:
            raise StaleValueError(_stale(context, "", path, str(error))) from error
        return _current(context, value, "", path)


# Field metadata of an asset value's dataclass: values stored before the field existed load with its default.
STORED_BEFORE_IT = "tessera.default_means_stored_before_it"


class StaleValueError(RuntimeError):
    """A stored asset value was written by a version of Tessera whose types have changed since."""


def _current(context: dg.InputContext, value, which: str, path):
    """A dataclass unpickled from an older version lacks the fields added since; without this
    check the step fails later with an AttributeError that names neither the asset nor the fix.
    A field whose metadata says its default is what an older value means (``STORED_BEFORE_IT: True``,
    e.g. "" for "not recorded", which the reader then looks up elsewhere) loads with that default; any
    other missing field is refused, even with a default: PublishedDataset.failed_checks = None reads
    "passed", which a value stored before the checks were recorded never said."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and hasattr(value, "__dict__"):
        absent = [field for field in dataclasses.fields(value) if field.name not in vars(value)]
        missing = [field.name for field in absent if not field.metadata.get(STORED_BEFORE_IT)]
        if missing:
            raise StaleValueError(_stale(context, which, path, f"{type(value).__name__} lacks {', '.join(missing)}"))
        for field in absent:
            if field.default_factory is not dataclasses.MISSING:
                object.__setattr__(value, field.name, field.default_factory())  # frozen dataclasses too
    return value


def _stale(context: dg.InputContext, which: str, path, detail: str) -> str:
    upstream = context.asset_key.to_user_string() if context.has_asset_key else context.upstream_output.name
    what = f"{upstream} {which}".strip()
    return (f"input {context.name!r}: the stored value of {what} at {path} was written by an older version of "
            f"Tessera ({detail}); materialize {what} again")


def _never_materialized(context: dg.InputContext, which: str, path, day: str | None = None) -> str:
    upstream = context.asset_key.to_user_string() if context.has_asset_key else context.upstream_output.name
    what = f"{upstream} {which}".strip()
    if day:
        assets = ", ".join(_daily_assets_this_step_reads_for(context, day) or [upstream])
        fix = f"materialize {assets} for partition {day} first (a backfill of those assets over that day)"
    else:
        fix = f"materialize {what} first"
    return (f"input {context.name!r} needs {what}, which has not been materialized here (no stored value "
            f"at {path}); {fix}" + _added_by_an_asset_backfill(context, which))



def _step_context(context: dg.InputContext):
    """The step's execution context, or None for an input context built outside a run."""
    try:
        return context.step_context
    except dg.DagsterInvariantViolationError:
        return None

def _daily_assets_this_step_reads_for(context: dg.InputContext, day: str) -> list[str]:
    """The daily assets this step reads for `day` and those they are built from (row_group_cache from
    training_dataset from raw_examples), in the order they are built: none may exist for a day outside
    every backfill so far, and naming only the input that failed first leaves the next one to fail.
    Those already materialized for `day` are left out (rebuilding raw_examples re-reads an export that
    retention may have deleted), except the input that failed: its stored value is missing regardless."""
    if (step := _step_context(context)) is None:
        return []
    asset_layer = step.job_def.asset_layer
    try:  # the run's job holds the assets its selection left out as stubs, without their partitions
        graph = step.repository_def.asset_graph
    except CheckError:  # a job executed outside a code location (materialize, execute_in_process): its parents only
        graph = asset_layer.asset_graph
    read: set[dg.AssetKey] = set()
    for step_input in step.step.step_inputs:
        upstream = asset_layer.get_asset_key_for_node_input(step.node_handle, step_input.name)
        if (upstream is not None and step.has_asset_partitions_for_input(step_input.name)
                and day in step.asset_partitions_subset_for_input(step_input.name).get_partition_keys()):
            read |= graph.get_ancestor_asset_keys(upstream, include_self=True)
    failed = context.asset_key if context.has_asset_key else None
    return [key.to_user_string() for key in graph.toposorted_asset_keys
            if key in read and graph.get(key).partitions_def is not None
            and (key == failed or not materialized_for_day(step.instance, key, day))]


def _added_by_an_asset_backfill(context: dg.InputContext, which: str) -> str:
    """Why this run's day is in its asset backfill at all, where Dagster added it beyond the range
    (assets/backfills.py): the day's own data, missing here, was never part of that backfill."""
    if not which:  # an unpartitioned input: no window, no added day
        return ""
    if (step := _step_context(context)) is None:
        return ""
    day = step.run_tags.get(PARTITION_NAME_TAG)
    if not day:
        return ""
    # Imported here: the assets package imports this one.
    from assets.backfills import day_added_beyond_backfill_range

    added = day_added_beyond_backfill_range(step.instance, step.run_tags, day, step.job_def.asset_layer.asset_graph)
    return f". {added}" if added else ""


class AtomicFilesystemIOManager(dg.FilesystemIOManager):
    """`FilesystemIOManager` (same `base_dir` rule: the instance's storage folder by default) with
    atomic writes.

    The default suits one machine (locally $DAGSTER_HOME/storage = $TESSERA_HOME/dagster/storage).
    Where steps run in separate pods, give a `base_dir` every step can read: the Kubernetes code
    location (`pipelines.resources_kubernetes`) puts it on the shared state volume."""

    @classmethod
    def _is_dagster_maintained(cls) -> bool:
        return False

    def create_io_manager(self, context: dg.InitResourceContext) -> AtomicPickleIOManager:
        return AtomicPickleIOManager(base_dir=self.base_dir or context.instance.storage_directory())
