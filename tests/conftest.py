"""Shared fixtures. Ray starts once per test process (it costs seconds), never per test.

`make test` runs two pytest-xdist workers with `--dist loadfile`: while one runs a CPU-bound
training test, the other's `dagster dev` or `tessera demo` subprocess is mostly importing and
waiting. Each test file runs whole on one worker, so its module fixtures (a `dagster dev`, a
two-node cluster) are built once and its tests keep their order; each worker that needs Ray starts
its own local instance. (`--dist loadgroup` would keep every Ray test on one worker, but
pytest-xdist 3.8 cannot rename items on pytest 9.2, so its groups are silently ignored.)"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")

import pytest  # noqa: E402

# CPython 3.11.7 can fail a later ast.parse with "AST constructor recursion depth mismatch" (a
# CPython bug, fixed in later releases). Hypothesis's pytest plugin imports hypothesis, through
# pytest's assertion rewriter, only in the terminal summary when no test imported it, and that
# parse turned a green single-process run (a file alone, `make test-fast`) into exit code 1.
import hypothesis  # noqa: E402, F401

from training_core.base_model import TinyLlamaSpec, build_demo_model, load_tokenizer  # noqa: E402
from training_core.data.dataset_writer import DatasetSpec, write_dataset  # noqa: E402
from training_core.data.demo_task import generate_records, tokenizer_corpus  # noqa: E402


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from training_core.train.ray_trainer import use_local_ray_defaults

    use_local_ray_defaults()  # one local node owned by this process, as the local code location runs it
    if not ray.is_initialized():
        # "local": never join a `ray start` cluster. No dashboard: its processes, idle, took ~2 CPU-s a
        # minute of this session's two cores (6.8 vs 4.6 CPU-s/min for the whole idle Ray), ~100 CPU-s per suite.
        ray.init(address="local", num_cpus=2, logging_level="warning", include_dashboard=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    return build_demo_model(tokenizer_corpus(), TinyLlamaSpec(), tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def demo_dataset(tmp_path_factory, demo_model):
    records = generate_records("2026-11-01", 2000)
    return write_dataset(
        records, load_tokenizer(demo_model.name_or_path), tmp_path_factory.mktemp("datasets"),
        DatasetSpec(row_group_rows=64), source_label="test",
    )
