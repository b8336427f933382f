"""row_group_cache: decoded row groups of the training dataset, warmed in the local disk cache."""


from dataclasses import dataclass
from pathlib import Path

import dagster as dg

from assets.data_assets import refuse_days_that_failed_checks
from assets.partitions import DAILY
from assets.step_start import start_step
from resources import RowGroupCache, TesseraStorage
from resources.paths import HOME_MARKER
from training_core.data import warm_cache
from training_core.data.batch_columns import TRAINING_COLUMNS, TRAINING_TRANSFORM, TRAINING_TRANSFORM_VERSION
from training_core.data.dataset_writer import PublishedDataset


@dataclass(frozen=True)
class WarmCache:
    directory: str
    cache_version: str
    entries: int
    bytes: int
    hit_rate: float


@dg.asset(partitions_def=DAILY, group_name="data", kinds={"diskcache"})
def row_group_cache(context: dg.AssetExecutionContext, storage: TesseraStorage, cache: RowGroupCache,
                    training_dataset: PublishedDataset):
    """Every row group decoded once into the FanoutCache, so training never waits on Parquet decode.
    The cache version is (dataset digest, columns, transform version)."""
    start_step(context)
    # The run's state folder, not the cache's: a cache may live in a pod-local home of its own
    # (docs/scaling_out.md) while datasets are published on the shared one.
    refuse_dataset_of_another_state_folder(training_dataset, storage.root, context.partition_key)
    if training_dataset.failed_checks:
        refuse_days_that_failed_checks({context.partition_key: training_dataset.failed_checks}, "row_group_cache")
    cache_config = cache.config()
    report = warm_cache(
        str(training_dataset.train_dir), cache_config, columns=TRAINING_COLUMNS, workers=2,
        dataset_digest=training_dataset.digest, transform=TRAINING_TRANSFORM,
        transform_version=TRAINING_TRANSFORM_VERSION,
    )
    context.log.info("cache %s: %d entries, hit rate %.2f", report.cache_version, report.entries, report.hit_rate)
    row_groups = report.hits + report.misses
    if report.entries < row_groups:  # the quota (or other datasets' entries under `evict`) left no room
        per_entry = report.bytes / report.entries if report.entries else None
        context.log.warning(
            f"row-group cache holds {report.entries} of this dataset's {row_groups} row groups: its quota "
            f"(cache.size_limit_bytes={cache.size_limit_bytes}, policy {cache.policy}) has no room for the rest"
            + (f" (~{per_entry * row_groups / 2**20:.0f} MiB for all of them)" if per_entry else "")
            + "; training decodes those from Parquet"
        )
    return dg.Output(
        WarmCache(str(cache_config.directory), report.cache_version, report.entries, report.bytes, report.hit_rate),
        metadata={"cache_version": report.cache_version, "entries": report.entries, "row_groups": row_groups,
                  "bytes": report.bytes,
                  "hit_rate": report.hit_rate, "misses": report.misses, "evictions": report.evictions,
                  "corruptions": report.corruptions, "orphan_files_removed": report.orphan_files_removed},
        data_version=dg.DataVersion(report.cache_version),
    )


def refuse_dataset_of_another_state_folder(dataset: PublishedDataset, root: Path, day: str) -> None:
    """Raise when ``dataset`` was published in a state folder other than ``root``. Dagster keeps step
    values in DAGSTER_HOME by asset and day only, not by storage.home: a training_dataset materialized
    with another home was warmed from that home's folder, silently, by a run on this one."""
    published_in = next((folder for folder in Path(dataset.path).resolve().parents
                         if (folder / HOME_MARKER).is_file()), None)
    if published_in is not None and published_in != root:  # a dataset outside any state folder: written directly
        raise dg.Failure(
            f"row_group_cache: the stored training_dataset for {day} is {dataset.path}, in state folder "
            f"{published_in}, not this run's {root} (storage.home / TESSERA_HOME): a run with another storage.home "
            f"materialized it. Materialize training_dataset for {day} in this state folder first"
        )
