"""Schedules, jobs and code-location wiring (no runs)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from datetime import datetime, timezone

import dagster as dg
import pytest
import yaml

from pipelines.definitions import defs
from resources import MlflowTracker, RowGroupCache, TesseraStorage
from training_core.errors import ConfigError


def _tick(when: datetime):
    schedule = defs.resolve_schedule_def("daily_retrain")
    with dg.instance_for_test() as instance:  # 2026-11-01 was trained, so 2026-11-02 is the day to train
        for asset in ("row_group_cache", "lora_adapter"):
            instance.report_runless_asset_event(dg.AssetMaterialization(asset, partition="2026-11-01"))
        # The inner `with` disposes of the context's weak reference to the instance before it closes.
        with dg.build_schedule_context(instance=instance, scheduled_execution_time=when,
                                       repository_def=defs.get_repository_def()) as context:
            return schedule.evaluate_tick(context)


def test_daily_schedule_requests_yesterdays_partition(monkeypatch):
    monkeypatch.delenv("TESSERA_RUN_CONFIG", raising=False)
    (request,) = _tick(datetime(2026, 11, 3, 2, 0, tzinfo=timezone.utc)).run_requests
    assert request.partition_key == "2026-11-02" and request.run_config == {}  # unset: the embedded demo defaults
    assert defs.resolve_schedule_def("daily_retrain").job_name == "train_and_promote"
    assert _tick(datetime(2026, 11, 1, 2, 0, tzinfo=timezone.utc)).skip_message == (
        "no day has closed since the first partition")


def test_scheduled_runs_take_the_operators_run_config_from_a_file(tmp_path, monkeypatch):
    # Without it every scheduled day would train the demo base model on generated data.
    run_config = tmp_path / "run_config.yaml"
    run_config.write_text("ops:\n  raw_examples:\n    config:\n      source: /data/exports\n"
                          "  base_model:\n    config:\n      name_or_path: /models/my-base\n")
    monkeypatch.setenv("TESSERA_RUN_CONFIG", str(run_config))
    (request,) = _tick(datetime(2026, 11, 3, 2, 0, tzinfo=timezone.utc)).run_requests
    assert request.run_config["ops"]["raw_examples"]["config"]["source"] == "/data/exports"
    assert request.run_config["ops"]["base_model"]["config"]["name_or_path"] == "/models/my-base"
    assert request.tags["tessera/run_config"] == str(run_config)


@pytest.mark.parametrize(("content", "message"), [
    (None, r"TESSERA_RUN_CONFIG=.*run_config.yaml: cannot read it"),
    ("ops: [unclosed", r"run_config.yaml: not valid YAML"),
    ("raw_examples:\n  source: x\n", r"expected Dagster run config, a mapping with 'ops'.*\['raw_examples'\]"),
])
def test_a_run_config_file_that_cannot_be_used_fails_the_tick_naming_it(tmp_path, monkeypatch, content, message):
    run_config = tmp_path / "run_config.yaml"
    if content is not None:
        run_config.write_text(content)
    monkeypatch.setenv("TESSERA_RUN_CONFIG", str(run_config))
    with pytest.raises(dg.DagsterUserCodeExecutionError) as failed:  # the tick fails; the UI shows the cause
        _tick(datetime(2026, 11, 3, 2, 0, tzinfo=timezone.utc))
    assert re.search(message, str(failed.value.user_exception)), failed.value.user_exception


def test_the_kubernetes_location_refuses_to_retrain_on_the_demo_defaults(monkeypatch):
    # A forgotten TESSERA_RUN_CONFIG in production must not train the demo model on generated data.
    import importlib

    monkeypatch.setenv("TESSERA_RAY_STORAGE", "/var/lib/tessera/ray")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    monkeypatch.delenv("TESSERA_RUN_CONFIG", raising=False)
    kubernetes_defs = importlib.import_module("pipelines.definitions_kubernetes").defs
    schedule = kubernetes_defs.resolve_schedule_def("daily_retrain")
    context = dg.build_schedule_context(scheduled_execution_time=datetime(2026, 11, 3, 2, 0, tzinfo=timezone.utc),
                                        repository_def=kubernetes_defs.get_repository_def())
    with pytest.raises(dg.DagsterUserCodeExecutionError) as failed:
        schedule.evaluate_tick(context)
    assert str(failed.value.user_exception).startswith("TESSERA_RUN_CONFIG is not set: this code location does not "
                                                       "retrain on the embedded demo defaults")
    assert "each tick fails" in schedule.description and "demo defaults" in defs.resolve_schedule_def(
        "daily_retrain").description


@pytest.mark.parametrize(("content", "left_on_the_demo"), [
    ("{}\n", "ops.raw_examples.config.source and ops.base_model.config.name_or_path"),
    ("resources: {}\n", "ops.raw_examples.config.source and ops.base_model.config.name_or_path"),
    ("ops:\n  lora_adapter:\n    config: {max_steps: 10}\n",
     "ops.raw_examples.config.source and ops.base_model.config.name_or_path"),
    ("ops:\n  raw_examples:\n    config: {source: /data/exports}\n", "ops.base_model.config.name_or_path"),
    ("ops:\n  raw_examples:\n    config: {source: demo}\n  base_model:\n    config: {name_or_path: /models/b}\n",
     "ops.raw_examples.config.source"),
])
def test_the_kubernetes_location_refuses_a_run_config_that_leaves_data_or_model_on_the_demo(
        tmp_path, monkeypatch, content, left_on_the_demo):
    # A file that sets only some settings falls back to the demo defaults for the rest.
    from pipelines.jobs import scheduled_run_config

    run_config = tmp_path / "daily_retrain.yaml"
    run_config.write_text(content)
    monkeypatch.setenv("TESSERA_RUN_CONFIG", str(run_config))
    assert scheduled_run_config(embedded_defaults_allowed=True) == yaml.safe_load(content)  # local: allowed
    with pytest.raises(ConfigError) as refused:
        scheduled_run_config(embedded_defaults_allowed=False)
    assert str(refused.value) == (f"TESSERA_RUN_CONFIG={run_config}: {left_on_the_demo} must name your own data and "
                                  "model: this code location does not retrain on the embedded demo defaults")


def test_the_launchpad_reaches_every_training_setting_an_operator_tunes():
    """Each launchpad field lands in the training config; its defaults are the training config's own
    (the demo's modules_to_save aside), so the config digest of a default launch does not move."""
    from assets.training_assets import TrainingRunConfig
    from training_core.train.config import TrainingConfig

    launchpad = set(TrainingRunConfig.model_fields)
    not_launchable = set(TrainingConfig.model_fields) - launchpad
    # lora: flattened into lora_* fields.
    assert not_launchable == {"lora"}
    default = TrainingRunConfig().training_config()
    assert default.model_dump(exclude={"lora"}) == TrainingConfig().model_dump(exclude={"lora"})
    assert default.lora.model_dump(exclude={"modules_to_save"}) == TrainingConfig().lora.model_dump(
        exclude={"modules_to_save"})
    assert default.lora.target_modules == "all-linear"  # PEFT's keyword, not a module called "all-linear"
    launched = TrainingRunConfig(lora_target_modules=["q_proj", "v_proj"], lora_dropout=0.1, lr_schedule="linear",
                                 warmup_steps=0, weight_decay=0.01, gradient_clipping=0.5, max_epochs=3,
                                 loader_workers=2, shuffle_buffer_row_groups=8).training_config()
    assert (launched.lora.target_modules, launched.lora.dropout) == (["q_proj", "v_proj"], 0.1)
    assert (launched.lr_schedule, launched.warmup_steps, launched.weight_decay, launched.gradient_clipping,
            launched.max_epochs, launched.loader_workers, launched.shuffle_buffer_row_groups) == (
        "linear", 0, 0.01, 0.5, 3, 2, 8)


@pytest.mark.parametrize("location", ["local", "kubernetes"])
def test_a_run_config_that_sets_the_state_folder_reaches_every_resource_that_writes_state(
        tmp_path, monkeypatch, location):
    """Cache and MLflow hold the storage resource inside them; a run config's storage.home must move
    their folders too, not only the datasets' (Dagster's own run history stays with DAGSTER_HOME)."""
    from pipelines.resources_kubernetes import kubernetes_resources
    from pipelines.resources_local import local_resources

    monkeypatch.setenv("TESSERA_RAY_STORAGE", str(tmp_path / "ray"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    resources = (local_resources(storage_set_at_launch=True) if location == "local" else kubernetes_resources())
    seen = {}

    @dg.asset
    def writes_state(storage: TesseraStorage, cache: RowGroupCache, mlflow_tracker: MlflowTracker) -> None:
        seen.update(datasets=storage.root, cache=cache.storage.root, mlflow=mlflow_tracker.storage.root)

    other = tmp_path / "other-home"
    result = dg.materialize([writes_state], resources={k: resources[k] for k in ("storage", "cache", "mlflow_tracker")},
                            run_config={"resources": {"storage": {"config": {"home": str(other)}}}})
    assert result.success and seen == {"datasets": other, "cache": other, "mlflow": other}


def test_training_is_limited_by_a_concurrency_pool():
    graph = defs.resolve_asset_graph()
    assert graph.get(dg.AssetKey("lora_adapter")).pools == {"training"}


def test_every_asset_has_a_description_and_data_assets_are_daily_partitioned():
    graph = defs.resolve_asset_graph()
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        assert node.description, f"{key.to_user_string()} has no description"
        if key.path[-1] != "base_model":
            assert node.partitions_def is not None, key


def test_blocking_checks_guard_dataset_and_promotion():
    graph = defs.resolve_asset_graph()
    blocking = {(k.asset_key.path[-1], k.name) for k in graph.asset_check_keys if graph.get_check_spec(k).blocking}
    assert {("training_dataset", "no_eval_leakage"), ("evaluation", "beats_base_model"),
            ("evaluation", "not_worse_than_champion")} <= blocking


def test_every_local_run_executes_its_steps_in_one_process():
    # UI launches, the schedule and backfills (Dagster's implicit asset job) alike: a process per
    # step would re-import torch, transformers and Ray before each step.
    jobs = [defs.resolve_job_def("train_and_promote"), defs.resolve_implicit_global_asset_job_def()]
    assert [job.executor_def.name for job in jobs] == ["in_process", "in_process"]


def test_loading_the_code_location_imports_no_ml_library():
    """Every Dagster process loads the code location (the code server, each run, `dagster dev`
    reloads): torch, transformers, MLflow and matplotlib are imported only by the work that uses
    them, not by the definitions (they made loading it ~10 s)."""
    heavy = ["torch", "transformers", "tokenizers", "peft", "deepspeed", "mlflow", "matplotlib", "ray.train"]
    script = f"import sys, pipelines.definitions; print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr


def test_asset_values_between_steps_are_written_atomically(tmp_path):
    import pickle

    from upath import UPath

    from pipelines.resources_kubernetes import kubernetes_resources
    from pipelines.resources_local import local_resources
    from resources.io_manager import AtomicFilesystemIOManager, AtomicPickleIOManager

    assert isinstance(local_resources()["io_manager"], AtomicFilesystemIOManager)
    assert isinstance(kubernetes_resources()["io_manager"], AtomicFilesystemIOManager)

    class Unpicklable:
        def __reduce__(self):
            raise pickle.PicklingError("cannot pickle this")

    manager = AtomicPickleIOManager(base_dir=str(tmp_path))
    path = UPath(tmp_path / "training_dataset")
    manager.dump_to_path(None, {"path": "/data/v1"}, path)
    with pytest.raises(Exception):  # fails after a megabyte is already written (a kill at that moment)
        manager.dump_to_path(None, ["x" * 2**20, Unpicklable()], path)
    assert manager.load_from_path(None, path) == {"path": "/data/v1"}  # the recorded value is intact
    assert [p.name for p in tmp_path.iterdir()] == ["training_dataset"]  # no temporary file left


def test_only_runs_whose_launcher_process_is_gone_are_failed_even_when_its_pid_was_reused():
    import psutil
    from dagster._core.storage.dagster_run import DagsterRun

    from pipelines.instance import LAUNCHER_TAG, fail_abandoned_runs
    from training_core.process_identity import process_is_gone, this_process

    # a PID now free (its process exited), ours with another start time, and one on another host
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    me = this_process()
    dead = f"{me.rsplit(':', 2)[0]}:{finished.stdout.strip()}:1.000"
    reused = f"{me.rsplit(':', 2)[0]}:{psutil.Process().pid}:{psutil.Process().create_time() - 60:.3f}"
    elsewhere = f"another-host:{finished.stdout.strip()}:1.000"
    assert not process_is_gone(me)
    assert process_is_gone(dead) and process_is_gone(reused)  # our PID, but started at another time
    assert not process_is_gone(elsewhere) and not process_is_gone("12345")  # cannot tell: left alone

    instance = dg.DagsterInstance.ephemeral()
    runs = {name: DagsterRun(job_name="train_and_promote", run_id=f"run-{name}", status=dg.DagsterRunStatus.STARTED,
                             tags={LAUNCHER_TAG: tag})
            for name, tag in {"alive": me, "dead": dead, "reused": reused, "elsewhere": elsewhere}.items()}
    for run in runs.values():
        instance.add_run(run)
    assert sorted(fail_abandoned_runs(instance)) == ["run-dead", "run-reused"]
    statuses = {name: instance.get_run_by_id(run.run_id).status for name, run in runs.items()}
    assert statuses == {"alive": dg.DagsterRunStatus.STARTED, "dead": dg.DagsterRunStatus.FAILURE,
                        "reused": dg.DagsterRunStatus.FAILURE, "elsewhere": dg.DagsterRunStatus.STARTED}


def _dead_process() -> str:
    from training_core.process_identity import this_process

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return f"{this_process().rsplit(':', 2)[0]}:{finished.stdout.strip()}:1.000"


def test_a_launcher_frees_the_slot_of_a_run_killed_while_it_waits():
    import threading

    from dagster._core.storage.dagster_run import DagsterRun

    from pipelines.instance import LAUNCHER_TAG, AbandonedRunWatch

    instance = dg.DagsterInstance.ephemeral()
    freed, seen = threading.Event(), []

    def on_freed(failed, released):
        seen.append((failed, released))
        freed.set()

    with AbandonedRunWatch(instance, on_freed, interval_s=0.05):
        # the slot holder dies after the launcher started waiting
        instance.add_run(DagsterRun(job_name="train_and_promote", run_id="run-killed",
                                    status=dg.DagsterRunStatus.STARTED, tags={LAUNCHER_TAG: _dead_process()}))
        assert freed.wait(timeout=30)
    assert seen == [(["run-killed"], [])]  # one call for the sweep that freed it, none for empty sweeps
    assert instance.get_run_by_id("run-killed").status == dg.DagsterRunStatus.FAILURE


def test_a_reexecuted_run_is_not_judged_by_the_launcher_tag_it_copied_from_its_parent():
    # Re-execute (UI, run-retry daemon) copies the parent's tags: the copied launcher names the
    # parent's process, gone by then, while the retry runs live in another process.
    from dagster._core.storage.dagster_run import DagsterRun

    from assets.run_identity import record_this_process
    from pipelines.instance import LAUNCHER_TAG, fail_abandoned_runs
    from training_core.process_identity import this_process

    instance = dg.DagsterInstance.ephemeral()
    gone = _dead_process()
    instance.add_run(DagsterRun(job_name="train_and_promote", run_id="parent", status=dg.DagsterRunStatus.FAILURE,
                                tags={LAUNCHER_TAG: gone}))
    instance.add_run(DagsterRun(job_name="train_and_promote", run_id="retry", status=dg.DagsterRunStatus.STARTED,
                                tags={LAUNCHER_TAG: gone, "dagster/parent_run_id": "parent"}))
    instance.add_run(DagsterRun(job_name="train_and_promote", run_id="killed-retry", status=dg.DagsterRunStatus.STARTED,
                                tags={LAUNCHER_TAG: _dead_process(), "dagster/parent_run_id": "parent"}))
    # the retry's own (recorded) process is judged; the copied tag is not
    assert fail_abandoned_runs(instance) == ["killed-retry"]
    assert instance.get_run_by_id("retry").status == dg.DagsterRunStatus.STARTED

    class TrainingStepContext:  # what a step's context gives record_this_process
        run, run_id = instance.get_run_by_id("retry"), "retry"

    TrainingStepContext.instance = instance
    record_this_process(TrainingStepContext)
    assert instance.get_run_by_id("retry").tags[LAUNCHER_TAG] == this_process()  # replaced by the live one


def test_a_run_started_outside_tessera_is_tagged_with_its_process_by_its_step():
    from assets.run_identity import LAUNCHER_TAG, record_this_process
    from training_core.process_identity import this_process

    @dg.asset
    def holds_a_pool_slot(context) -> None:
        record_this_process(context)

    instance = dg.DagsterInstance.ephemeral()
    untagged = dg.materialize([holds_a_pool_slot], instance=instance)  # as the Dagster CLI launches
    assert instance.get_run_by_id(untagged.run_id).tags[LAUNCHER_TAG] == this_process()
    tagged = dg.materialize([holds_a_pool_slot], instance=instance, tags={LAUNCHER_TAG: "launcher:1:2.000"})
    assert instance.get_run_by_id(tagged.run_id).tags[LAUNCHER_TAG] == "launcher:1:2.000"  # the launcher's kept


@dataclasses.dataclass(frozen=True)
class _StoredShape:
    path: str
    rows: int


def test_a_value_stored_by_an_older_version_is_named_with_what_to_rematerialize(tmp_path):
    """A dataclass that gained a field since a value was pickled unpickles without it; the
    downstream step then failed with an AttributeError naming neither the asset nor the fix."""
    import pickle

    from resources.io_manager import AtomicFilesystemIOManager, StaleValueError

    @dg.asset
    def stored() -> _StoredShape:
        return _StoredShape("/data/v1", 10)

    @dg.asset
    def reader(stored: _StoredShape) -> int:
        return stored.rows

    resources = {"io_manager": AtomicFilesystemIOManager(base_dir=str(tmp_path))}
    with dg.instance_for_test() as instance:
        assert dg.materialize([stored], instance=instance, resources=resources).success
        assert dg.materialize([stored, reader], selection=[reader], instance=instance, resources=resources).success
        older = _StoredShape("/data/v0", 1)
        object.__delattr__(older, "rows")  # as pickled before the field existed
        (tmp_path / "stored").write_bytes(pickle.dumps(older))
        with pytest.raises(StaleValueError, match=r"^input 'stored': the stored value of stored at .*stored was "
                                                  r"written by an older version of Tessera \(_StoredShape lacks rows\); "
                                                  r"materialize stored again$"):
            dg.materialize([stored, reader], selection=[reader], instance=instance, resources=resources)


@dataclasses.dataclass(frozen=True)
class _StoredShapeWithDefaults:
    path: str
    # Added later, with defaults that say what older values mean.
    digest: str = dataclasses.field(default="", metadata={"tessera.default_means_stored_before_it": True})
    tags: tuple = dataclasses.field(default_factory=tuple, metadata={"tessera.default_means_stored_before_it": True})
    # Added later too, but None would claim something older values never said (as failed_checks: passed).
    failed_checks: tuple | None = None


def test_a_value_stored_before_fields_were_added_loads_only_where_their_defaults_say_so(tmp_path):
    """TrainedModel.base_model_digest: a field added with a default marked as what older values mean
    loads (refusing it forced a retrain of every day stored before an upgrade); other new fields are
    still refused (PublishedDataset.failed_checks = None would read a never-checked day as passed)."""
    import pickle

    from resources.io_manager import STORED_BEFORE_IT, AtomicFilesystemIOManager, StaleValueError

    assert STORED_BEFORE_IT == "tessera.default_means_stored_before_it"

    @dg.asset
    def stored() -> _StoredShapeWithDefaults:
        return _StoredShapeWithDefaults("/data/v1", "d1", ("x",), ())

    @dg.asset
    def reader(stored: _StoredShapeWithDefaults) -> tuple:
        return stored.path, stored.digest, stored.tags

    resources = {"io_manager": AtomicFilesystemIOManager(base_dir=str(tmp_path))}
    with dg.instance_for_test() as instance:
        assert dg.materialize([stored], instance=instance, resources=resources).success
        older = _StoredShapeWithDefaults("/data/v0", failed_checks=())
        object.__delattr__(older, "digest")  # as pickled before the fields existed
        object.__delattr__(older, "tags")
        (tmp_path / "stored").write_bytes(pickle.dumps(older))
        result = dg.materialize([stored, reader], selection=[reader], instance=instance, resources=resources)
        assert result.output_for_node("reader") == ("/data/v0", "", ())

        object.__delattr__(older, "failed_checks")
        (tmp_path / "stored").write_bytes(pickle.dumps(older))
        with pytest.raises(StaleValueError, match=r"\(_StoredShapeWithDefaults lacks failed_checks\)"):
            dg.materialize([stored, reader], selection=[reader], instance=instance, resources=resources)


def test_a_failed_demo_ends_with_the_failing_step_and_its_own_error():
    from pipelines.cli import step_failures

    @dg.asset
    def upstream() -> int:
        return 1

    @dg.asset
    def broken(upstream: int) -> int:
        raise ValueError(f"bad row {upstream} in data.jsonl")

    result = dg.materialize([upstream, broken], raise_on_error=False)
    assert not result.success
    assert step_failures(result) == [("broken", "ValueError: bad row 1 in data.jsonl")]


def test_a_cache_quota_too_small_for_the_dataset_is_reported_by_the_warming_step(tmp_path, demo_dataset, capfd):
    from assets.cache_assets import row_group_cache
    from resources import RowGroupCache, TesseraStorage

    def warm(cache: RowGroupCache) -> tuple[dict, str]:
        capfd.readouterr()
        output = row_group_cache(dg.build_asset_context(partition_key="2026-11-01"), storage=cache.storage,
                                 cache=cache, training_dataset=demo_dataset)
        return {name: value.value for name, value in output.metadata.items()}, capfd.readouterr().err  # Dagster's log

    roomy, log = warm(RowGroupCache(storage=TesseraStorage(home=str(tmp_path / "roomy"))))
    assert roomy["entries"] == roomy["row_groups"] == demo_dataset.row_groups
    assert f": {demo_dataset.row_groups} entries, hit rate" in log  # the step's info line: the log is captured
    assert "row-group cache holds" not in log

    # Shard volumes include SQLite's own pages, so which quota holds how much is found, not computed.
    partial_seen = False
    for quota in range(150_000, 350_001, 25_000):
        tight, log = warm(RowGroupCache(storage=TesseraStorage(home=str(tmp_path / f"q{quota}")),
                                        size_limit_bytes=quota, policy="stop_admitting"))
        assert tight["row_groups"] == demo_dataset.row_groups
        warned = (f"row-group cache holds {tight['entries']} of this dataset's {demo_dataset.row_groups} row groups: "
                  f"its quota (cache.size_limit_bytes={quota}, policy stop_admitting) has no room for the rest")
        assert (warned in log) == (tight["entries"] < tight["row_groups"])
        partial_seen |= 0 < tight["entries"] < tight["row_groups"]
    assert partial_seen  # some quota in the range held part of the dataset


def test_free_slots_fails_only_runs_whose_process_is_gone(tmp_path, capsys, monkeypatch):
    from dagster._core.storage.dagster_run import DagsterRun

    from pipelines.cli import main
    from pipelines.instance import LAUNCHER_TAG, prepare_home
    from training_core.process_identity import this_process

    monkeypatch.setenv("TESSERA_HOME", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "elsewhere"))
    assert main(["free-slots", "--home", str(tmp_path / "typo")]) == 2
    assert "has no Dagster instance" in capsys.readouterr().err and not (tmp_path / "typo").exists()

    prepare_home(str(tmp_path))
    instance = dg.DagsterInstance.get()
    for name, launcher in {"killed": _dead_process(), "alive": this_process()}.items():
        instance.add_run(DagsterRun(job_name="train_and_promote", run_id=f"run-{name}",
                                    status=dg.DagsterRunStatus.STARTED, tags={LAUNCHER_TAG: launcher}))
    assert main(["free-slots", "--home", str(tmp_path)]) == 0
    assert "run run-killed was abandoned" in capsys.readouterr().out
    statuses = {name: dg.DagsterInstance.get().get_run_by_id(f"run-{name}").status for name in ("killed", "alive")}
    assert statuses == {"killed": dg.DagsterRunStatus.FAILURE, "alive": dg.DagsterRunStatus.STARTED}
