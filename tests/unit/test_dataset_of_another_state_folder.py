"""Dagster keeps step values in DAGSTER_HOME by asset and day, not by storage.home: a training_dataset
materialized by a run with its own storage.home was then warmed, silently, by a row_group_cache run on
the default home. row_group_cache refuses it, naming both folders."""

from __future__ import annotations

import re

import dagster as dg
import pytest

from training_core.base_model import load_tokenizer
from training_core.data.dataset_writer import DatasetSpec, write_dataset
from training_core.data.demo_task import generate_records

DAY = "2026-11-03"


def test_row_group_cache_refuses_a_training_dataset_published_in_another_state_folder(tmp_path, demo_model):
    from assets.cache_assets import row_group_cache
    from resources import RowGroupCache, TesseraStorage

    other_home, this_home = TesseraStorage(home=str(tmp_path / "other")), TesseraStorage(home=str(tmp_path / "this"))
    # Where training_dataset publishes it, in the state folder of the run that materialized it.
    dataset = write_dataset(generate_records(DAY, 300), load_tokenizer(demo_model.name_or_path),
                            other_home.folder("datasets") / "training" / DAY, DatasetSpec(row_group_rows=64),
                            source_label="test")

    def warm(storage: TesseraStorage) -> dg.Output:
        return row_group_cache(dg.build_asset_context(partition_key=DAY), storage=storage,
                               cache=RowGroupCache(storage=storage), training_dataset=dataset)

    expected = (f"row_group_cache: the stored training_dataset for {DAY} is {dataset.path}, in state folder "
                f"{other_home.root}, not this run's {this_home.root} (storage.home / TESSERA_HOME): a run with "
                f"another storage.home materialized it. Materialize training_dataset for {DAY} in this state "
                "folder first")
    with pytest.raises(dg.Failure, match=f"^{re.escape(expected)}$"):
        warm(this_home)
    assert not (this_home.root / "cache").exists()  # refused before anything was warmed

    warmed = warm(other_home)  # in its own state folder: warmed as before
    assert warmed.value.entries == dataset.row_groups


def test_a_cache_in_a_pod_local_home_of_its_own_warms_the_shared_state_folders_dataset(tmp_path, demo_model):
    """docs/scaling_out.md: on Kubernetes the cache may live in a pod-local home (SQLite off NFS) while
    datasets are published on the shared one. The state folder that matters is the run's, not the cache's."""
    from assets.cache_assets import row_group_cache
    from resources import RowGroupCache, TesseraStorage

    shared, pod_local = TesseraStorage(home=str(tmp_path / "shared")), TesseraStorage(home=str(tmp_path / "pod"))
    dataset = write_dataset(generate_records(DAY, 300), load_tokenizer(demo_model.name_or_path),
                            shared.folder("datasets") / "training" / DAY, DatasetSpec(row_group_rows=64),
                            source_label="test")

    warmed = row_group_cache(dg.build_asset_context(partition_key=DAY), storage=shared,
                             cache=RowGroupCache(storage=pod_local), training_dataset=dataset).value

    assert warmed.entries == dataset.row_groups
    assert warmed.directory.startswith(str(pod_local.root))
