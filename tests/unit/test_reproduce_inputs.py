"""`tessera reproduce RUN_ID` on bad input: each case is a LineageError naming the run and the fault,
never a traceback. Runs are recorded in a real SQLite MLflow store, with the real lineage writer."""

from __future__ import annotations

import json
import shutil
import sqlite3
import tempfile
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from training_core.data import cache_version
from training_core.data.batch_columns import TRAINING_COLUMNS
from training_core.data.window import window_digest
from training_core.errors import LineageError
from training_core.evaluate.settings import EvalSettings
from training_core.lineage import build_lineage_record, code_version, parse_dataset_paths
from training_core.reproduce import CONFIG_ARTIFACT, TRANSFORM_VERSION, compare_runs, lineage_drift, load_recorded_run
from training_core.storage import directory_digest
from training_core.tracking import MlflowTracking
from training_core.train.config import TrainingConfig

SEQ_LEN = 32


@pytest.fixture
def tracking(tmp_path: Path) -> MlflowTracking:
    return MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")


def _published_dataset(folder: Path) -> Path:
    """A stand-in for a published dataset: what reproduce digests and reads (manifest seq_len)."""
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"spec": {"seq_len": SEQ_LEN}}))
    (folder / "train").mkdir()
    (folder / "train" / "part-000.parquet").write_bytes(f"rows of {folder.name}".encode())
    return folder


def _record_run(
    tracking: MlflowTracking,
    tmp_path: Path,
    datasets: list[Path],
    *,
    status: str | None = "FINISHED",
    drop: tuple[str, ...] = (),
    overrides: dict[str, str] | None = None,
    config_text: str | None = None,
) -> str:
    """A run as `run_tracked_training` leaves it: lineage params, the config artifact, a status
    (None: never ended, as while training). `config_text=""` logs no config artifact."""
    config = TrainingConfig()
    digests = [directory_digest(d) for d in datasets]
    base = tmp_path / "base-model"  # a stand-in for a user's model folder: what reproduce digests
    base.mkdir(exist_ok=True)
    (base / "config.json").write_text("{}")
    params = build_lineage_record(
        seed=config.seed, data_seed=config.data_seed,
        dataset_digest=window_digest(digests), dataset_paths=[str(d) for d in datasets],
        cache_version=window_digest([cache_version(d, TRAINING_COLUMNS, TRANSFORM_VERSION) for d in digests]),
        base_model=str(base), base_model_digest=directory_digest(base), config_digest=config.digest(),
        dagster_run_id="dagster-run", partition_keys=["2026-11-01"],
    )
    params = {k: v for k, v in {**params, **(overrides or {})}.items() if k not in drop}
    run_id = tracking.start_run("train-test", tags={})
    tracking.log_batch(run_id, params=params)
    if config_text != "":
        artifact = tmp_path / f"upload-{run_id}" / CONFIG_ARTIFACT
        artifact.parent.mkdir()
        artifact.write_text(config_text if config_text is not None else json.dumps(config.model_dump(mode="json")))
        tracking.client.log_artifact(run_id, str(artifact))
    if status is not None:
        tracking.end_run(run_id, status=status)
    return run_id


def _refusal(tracking: MlflowTracking, run_id: str) -> str:
    with pytest.raises(LineageError) as caught:
        load_recorded_run(tracking, run_id, cache_directory=None)
    message = str(caught.value)
    assert run_id in message, message
    return message


def test_a_finished_run_with_a_comma_in_its_dataset_path_round_trips(tracking, tmp_path):
    dataset = _published_dataset(tmp_path / "datasets" / "day,2026-11-01")
    run_id = _record_run(tracking, tmp_path, [dataset])

    assert json.loads(tracking.client.get_run(run_id).data.params["dataset_paths"]) == [str(dataset)]
    recorded = load_recorded_run(tracking, run_id, cache_directory=None)
    assert recorded.inputs.dataset_paths == [str(dataset)]
    assert recorded.inputs.seq_len == SEQ_LEN
    assert recorded.config == TrainingConfig()


def test_runs_recorded_with_comma_separated_dataset_paths_are_still_read(tracking, tmp_path):
    first, second = (_published_dataset(tmp_path / "datasets" / day) for day in ("2026-11-01", "2026-11-02"))
    run_id = _record_run(tracking, tmp_path, [first, second], overrides={"dataset_paths": f"{first},{second}"})

    assert load_recorded_run(tracking, run_id, cache_directory=None).inputs.dataset_paths == [str(first), str(second)]


def test_the_evaluation_settings_a_run_was_scored_with_are_read_back(tracking, tmp_path):
    dataset = _published_dataset(tmp_path / "datasets" / "2026-11-01")
    run_id = _record_run(tracking, tmp_path, [dataset])
    assert load_recorded_run(tracking, run_id, None).eval_settings == EvalSettings("cpu", "fp32", 64)  # before tags
    tracking.log_batch(run_id, tags=EvalSettings("cuda", "bf16", 16).as_tags())
    assert load_recorded_run(tracking, run_id, None).eval_settings == EvalSettings("cuda", "bf16", 16)
    tracking.log_batch(run_id, tags={"tessera.eval.precision": "fp8"})
    assert "its evaluation settings cannot be read back: evaluation precision must be one of" in _refusal(tracking, run_id)


def test_a_reproduction_fails_before_training_when_this_machine_cannot_evaluate_as_the_run_was(
        tracking, tmp_path, monkeypatch):
    from pipelines import reproduce

    dataset = _published_dataset(tmp_path / "datasets" / "2026-11-01")
    run_id = _record_run(tracking, tmp_path, [dataset])
    tracking.log_batch(run_id, tags=EvalSettings("cuda", "bf16", 16).as_tags())
    recorded = load_recorded_run(tracking, run_id, None)
    monkeypatch.setattr(reproduce, "local_resources", lambda: _resources_for(tracking, tmp_path))
    monkeypatch.setattr(reproduce, "load_recorded_run", lambda *args: recorded)
    monkeypatch.setattr(reproduce, "_connect_to_ray", lambda address: None)
    monkeypatch.setattr(reproduce, "gpu_available_in_cluster", lambda: False)
    monkeypatch.setattr(reproduce, "run_tracked_training", _must_not_train)
    output = StringIO()
    assert reproduce.reproduce_run(run_id, Console(file=output, width=300)) == 2
    assert "cannot reproduce: run" in output.getvalue()
    assert "device='cuda' but the process that evaluates sees no CUDA GPU" in output.getvalue()


def test_a_metric_the_original_never_recorded_is_shown_but_not_counted_as_a_mismatch(tracking):
    original, reproduced = tracking.start_run("original", tags={}), tracking.start_run("reproduced", tags={})
    tracking.log_batch(original, metrics={"train_loss": 0.5, "steps": 10.0})  # its evaluation step never ran
    tracking.log_batch(reproduced, metrics={"train_loss": 0.5, "steps": 10.0, "eval_loss": 0.7})
    rows = {name: (a, b, equal) for name, a, b, equal in compare_runs(tracking, original, reproduced)}
    assert rows["eval_loss"] == (None, 0.7, None)
    assert rows["train_loss"] == (0.5, 0.5, True)
    tracking.log_batch(original, metrics={"eval_exact_match": 1.0})  # recorded by the original, missing now
    rows = {name: equal for name, _, _, equal in compare_runs(tracking, original, reproduced)}
    assert rows["eval_exact_match"] is False


def test_curves_that_differ_are_shown_at_their_first_differing_step(tracking):
    original, reproduced, same = (tracking.start_run(name, tags={}) for name in ("original", "reproduced", "same"))
    for run_id, losses in ((original, [2.0, 1.5, 1.25]), (reproduced, [2.0, 1.5000000001, 1.25]),
                           (same, [2.0, 1.5, 1.25])):
        for step, loss in enumerate(losses, start=1):
            tracking.client.log_metric(run_id, "train_loss", loss, step=step)
    rows = {name: (a, b, equal) for name, a, b, equal in compare_runs(tracking, original, reproduced)}
    assert rows["train_loss curve"] == ("step 2: 1.5", "step 2: 1.5000000001", False)
    rows = {name: (a, b, equal) for name, a, b, equal in compare_runs(tracking, original, same)}
    assert rows["train_loss curve"] == ("3 steps", "3 steps", True)


def _must_not_train(*args, **kwargs):
    raise AssertionError("training started although evaluation could not run as recorded")


def _resources_for(tracking: MlflowTracking, tmp_path: Path) -> dict:
    from resources import LocalRayCluster, RowGroupCache, TesseraStorage

    storage = TesseraStorage(home=str(tmp_path))
    (tmp_path / "mlflow.db").touch(exist_ok=True)
    return {"storage": storage, "mlflow_tracker": _FixedTracker(tracking), "cache": RowGroupCache(storage=storage),
            "ray_cluster": LocalRayCluster()}


class _FixedTracker:
    tracking_uri = "sqlite:///in-the-test"

    def __init__(self, tracking: MlflowTracking) -> None:
        self._tracking = tracking

    def client(self, create_missing: bool = True) -> MlflowTracking:
        return self._tracking


@pytest.mark.parametrize("value", ["[]", "", '[""]'])
def test_a_run_naming_no_dataset_is_refused(tracking, tmp_path, value):
    run_id = _record_run(tracking, tmp_path, [_published_dataset(tmp_path / "d")], overrides={"dataset_paths": value})
    assert "dataset_paths" in _refusal(tracking, run_id)


def test_dataset_paths_that_are_json_but_not_a_list_of_paths_are_refused(tracking, tmp_path):
    with pytest.raises(ValueError, match="JSON list of path strings"):
        parse_dataset_paths('[1, 2]')
    run_id = _record_run(tracking, tmp_path, [_published_dataset(tmp_path / "d")], overrides={"dataset_paths": "[oops"})
    assert "param dataset_paths is not a list of paths" in _refusal(tracking, run_id)


def test_a_changed_file_of_a_users_base_model_is_named(tracking, tmp_path, demo_model):
    import shutil

    from training_core.base_model import resolve_pretrained

    folder = tmp_path / "users-model"
    shutil.copytree(demo_model.name_or_path, folder)
    (folder / ".file-digests.json").unlink()  # a user's folder: its per-file record is kept in the state folder
    records = tmp_path / "base-digests"
    base = resolve_pretrained(str(folder), records)
    dataset = _published_dataset(tmp_path / "datasets" / "2026-11-01")
    run_id = _record_run(tracking, tmp_path, [dataset],
                         overrides={"base_model": str(folder), "base_model_digest": base.digest})
    assert load_recorded_run(tracking, run_id, None, records).inputs.base_model == str(folder)
    (folder / "generation_config.json").write_text("{}")
    with pytest.raises(LineageError, match=rf"base model {folder} no longer matches its recorded digest: "
                                           rf"{folder / 'generation_config.json'} \(changed\)"):
        load_recorded_run(tracking, run_id, None, records)


def test_a_run_still_running_is_refused_with_what_to_do(tracking, tmp_path):
    run_id = _record_run(tracking, tmp_path, [_published_dataset(tmp_path / "d")], status=None)
    message = _refusal(tracking, run_id)
    assert "still running" in message and "if its process died" in message


@pytest.mark.parametrize("status", ["FAILED", "KILLED"])
def test_a_run_that_did_not_finish_is_refused(tracking, tmp_path, status):
    # lineage params are only logged once training succeeded, so a failed run usually has none
    run_id = tracking.start_run("train-test", tags={})
    tracking.end_run(run_id, status=status)
    message = _refusal(tracking, run_id)
    assert f"ended {status}" in message and "did not finish" in message
    assert "lacks lineage params" not in message


def test_a_run_without_config_digest_is_refused(tracking, tmp_path):
    run_id = _record_run(tracking, tmp_path, [_published_dataset(tmp_path / "d")], drop=("config_digest",))
    assert "lacks lineage params ['config_digest']" in _refusal(tracking, run_id)


def test_a_missing_config_artifact_is_named(tracking, tmp_path):
    run_id = _record_run(tracking, tmp_path, [_published_dataset(tmp_path / "d")], config_text="")
    assert f"cannot read its artifact {CONFIG_ARTIFACT}" in _refusal(tracking, run_id)


@pytest.mark.parametrize(("text", "fault"), [
    ('{"seed": 0,', "is not valid JSON"),
    ("\xff\xfe garbage", "is not valid JSON"),
    ("[1, 2]", "holds a JSON list, not a config object"),
    ('{"micro_batch_size": 8, "no_such_field": 1}', "no_such_field"),
])
def test_a_garbled_config_artifact_is_named(tracking, tmp_path, text, fault):
    run_id = _record_run(tracking, tmp_path, [_published_dataset(tmp_path / "d")], config_text=text)
    message = _refusal(tracking, run_id)
    assert CONFIG_ARTIFACT in message and fault in message


def test_a_config_artifact_that_differs_from_its_digest_is_refused(tracking, tmp_path):
    edited = json.dumps(TrainingConfig(max_steps=7).model_dump(mode="json"))
    run_id = _record_run(tracking, tmp_path, [_published_dataset(tmp_path / "d")], config_text=edited)
    assert "does not match its recorded config_digest" in _refusal(tracking, run_id)


def test_the_config_is_downloaded_into_a_folder_that_is_removed(tracking, tmp_path, monkeypatch):
    run_id = _record_run(tracking, tmp_path, [_published_dataset(tmp_path / "d")])
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    load_recorded_run(tracking, run_id, cache_directory=None)
    assert list(scratch.iterdir()) == []


def test_an_unknown_run_and_a_malformed_id_are_told_apart(tracking):
    assert "not found at sqlite:" in _refusal(tracking, "0123456789abcdef0123456789abcdef")
    assert "is not an MLflow run id" in _refusal(tracking, "not a run!")


def test_a_damaged_store_is_not_reported_as_a_missing_run(tracking, tmp_path):
    run_id = _record_run(tracking, tmp_path, [_published_dataset(tmp_path / "d")])
    with sqlite3.connect(tmp_path / "mlflow.db") as db:  # damaged: the runs table is gone
        db.execute("PRAGMA foreign_keys = OFF")
        db.execute("DROP TABLE runs")
    message = _refusal(tracking, run_id)
    assert f"from the tracking store at {tracking.tracking_uri}" in message
    assert "not found" not in message


def test_drift_names_changed_code_and_package_versions_only():
    params = {"code_version": "0" * 40, "version_torch": "0.0.1", "version_pyarrow": _installed("pyarrow"),
              "version_no-such-package": "1.0", "seed": "0"}
    drift = lineage_drift(params)
    assert drift == [
        ("code_version", "0" * 40, code_version()),
        ("version_no-such-package", "1.0", "not installed"),
        ("version_torch", "0.0.1", _installed("torch")),
    ]
    assert lineage_drift({k: now for k, _, now in drift}) == []


def test_drift_is_printed_as_a_note_with_each_change():
    from pipelines.reproduce import print_drift

    output = StringIO()
    print_drift(Console(file=output, width=200), "run-1", [("version_torch", "2.0.0", "2.1.0")])
    text = output.getvalue()
    assert "note:" in text and "run-1" in text and "version_torch: 2.0.0 → 2.1.0" in text
    output = StringIO()
    print_drift(Console(file=output, width=200), "run-1", [])
    assert output.getvalue() == ""


def _installed(package: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(package)


def test_reproduce_with_a_mistyped_home_is_refused_and_creates_nothing(tmp_path, capsys):
    from pipelines.cli import main

    typo = tmp_path / "tesera-home"
    assert main(["reproduce", "some-run", "--home", str(typo)]) == 2
    assert f"tessera reproduce: state folder {typo} is not usable: it does not exist; pass --home" in capsys.readouterr().err
    assert not typo.exists()


def test_reproduce_in_a_state_folder_without_an_mlflow_store_creates_none(tmp_path, monkeypatch):
    from io import StringIO

    from rich.console import Console

    from pipelines.reproduce import reproduce_run

    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    output = StringIO()
    assert reproduce_run("0123456789abcdef0123456789abcdef", Console(file=output, width=300)) == 2
    assert f"cannot reproduce: no MLflow store at {tmp_path / 'mlflow.db'}; pass --home" in output.getvalue()
    assert not (tmp_path / "mlflow.db").exists()


def test_a_config_field_added_since_the_run_is_filled_from_its_default_as_a_note_not_a_refusal(tracking, tmp_path):
    import hashlib

    from pipelines.reproduce import print_drift

    recorded = TrainingConfig().model_dump(mode="json")
    recorded.pop("peak_flops_preset")  # as recorded by a Tessera before the field existed
    recorded["lora"].pop("dropout")  # a nested one too
    run_id = _record_run(tracking, tmp_path, [_published_dataset(tmp_path / "d")], config_text=json.dumps(recorded),
                         overrides={"config_digest": hashlib.sha256(json.dumps(recorded, sort_keys=True).encode())
                                    .hexdigest()})
    run = load_recorded_run(tracking, run_id, None)
    assert run.config == TrainingConfig()
    assert run.config_drift == [("config.lora.dropout", "not recorded", "0.0 (default)"),
                                ("config.peak_flops_preset", "not recorded", "'auto' (default)")]
    output = StringIO()
    print_drift(Console(file=output, width=200), run_id, run.config_drift)
    assert "config.peak_flops_preset: not recorded → 'auto' (default)" in output.getvalue()


def _store_outside_the_state_folder(tmp_path: Path) -> tuple[Path, str, str]:
    """A state folder without mlflow.db, and a run in another store (as a tracking server holds it)."""
    home = tmp_path / "home"
    home.mkdir()
    uri = f"sqlite:///{home / 'server.db'}"
    server = MlflowTracking(uri, home / "mlartifacts")
    run_id = _record_run(server, tmp_path, [_published_dataset(tmp_path / "d")])
    shutil.rmtree(tmp_path / "d")  # refused after the run is read: no training starts
    return home, uri, run_id


def test_reproduce_reads_the_state_folders_store_whatever_mlflow_tracking_uri_says(tmp_path, monkeypatch):
    # Local runs are recorded in $TESSERA_HOME/mlflow.db; a variable exported for other MLflow work is not
    # where they are (nor where a reproduction may create an experiment).
    from pipelines.reproduce import reproduce_run

    home, uri, run_id = _store_outside_the_state_folder(tmp_path)
    monkeypatch.setenv("TESSERA_HOME", str(home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    output = StringIO()
    assert reproduce_run(run_id, Console(file=output, width=300)) == 2
    assert f"no MLflow store at {home / 'mlflow.db'}" in output.getvalue()
    assert not (home / "mlflow.db").exists()


def test_reproduce_reads_the_run_from_the_tracking_uri_option(tmp_path, monkeypatch, capsys):
    from pipelines.cli import main

    home, uri, run_id = _store_outside_the_state_folder(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path / "elsewhere"))  # --home wins, and is written back
    assert main(["reproduce", run_id, "--home", str(home), "--tracking-uri", uri]) == 2
    assert f"cannot reproduce: run {run_id}: dataset {tmp_path / 'd'} is gone" in capsys.readouterr().out
    assert main(["reproduce", run_id, "--home", str(home)]) == 2  # without it: the state folder's store
    assert f"no MLflow store at {home / 'mlflow.db'}" in capsys.readouterr().out


def test_reproduce_leaves_no_experiment_of_its_own_in_the_store(tmp_path, monkeypatch, capsys):
    # A team's server whose runs are logged to their own experiment: reading a run there, or an id it does
    # not hold, must not add an empty experiment named by this deployment's default ("tessera").
    from pipelines.cli import main

    home = tmp_path / "home"
    home.mkdir()
    uri = f"sqlite:///{home / 'server.db'}"
    server = MlflowTracking(uri, home / "mlartifacts", experiment="team-llm")
    run_id = _record_run(server, tmp_path, [_published_dataset(tmp_path / "d")])
    shutil.rmtree(tmp_path / "d")  # refused after the run is read: no training starts
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["reproduce", run_id, "--home", str(home), "--tracking-uri", uri]) == 2
    assert f"dataset {tmp_path / 'd'} is gone" in capsys.readouterr().out
    assert main(["reproduce", "0" * 32, "--home", str(home), "--tracking-uri", uri]) == 2
    assert "0" * 32 in capsys.readouterr().out
    assert server.client.get_experiment_by_name("tessera") is None


def test_reproduce_reads_the_cache_under_the_cache_resources_quota_and_policy(tracking, tmp_path, monkeypatch):
    from pipelines import reproduce
    from resources import RowGroupCache

    run_id = _record_run(tracking, tmp_path, [_published_dataset(tmp_path / "datasets" / "2026-11-01")])
    resources = _resources_for(tracking, tmp_path)
    resources["cache"] = RowGroupCache(storage=resources["storage"], size_limit_bytes=12345, policy="stop_admitting")
    trained_with = {}

    def capture(config, inputs, *args, **kwargs):
        trained_with.update(quota=inputs.cache_size_limit_bytes, policy=inputs.cache_policy)
        raise _Stop

    monkeypatch.setattr(reproduce, "local_resources", lambda: resources)
    monkeypatch.setattr(reproduce, "_connect_to_ray", lambda address: None)
    monkeypatch.setattr(reproduce, "gpu_available_in_cluster", lambda: False)
    monkeypatch.setattr("resources.ray_cluster.alive_node_resources", lambda: [{"CPU": 64.0}])
    monkeypatch.setattr(reproduce, "run_tracked_training", capture)
    with pytest.raises(_Stop):
        reproduce.reproduce_run(run_id, Console(file=StringIO()))
    assert trained_with == {"quota": 12345, "policy": "stop_admitting"}


class _Stop(Exception):
    pass


def test_edits_outside_the_code_leave_the_code_version_clean(tmp_path):
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              capture_output=True, text=True, check=True).stdout.strip()

    (tmp_path / "training_core").mkdir()
    (tmp_path / "training_core" / "loop.py").write_text("steps = 1\n")
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    (tmp_path / "README.md").write_text("# readme\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "code")
    sha = git("rev-parse", "HEAD")

    (tmp_path / "README.md").write_text("# readme, a typo fixed\n")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "training.json").write_text("{}")  # as `tessera bench train` rewrites it
    assert code_version(tmp_path) == sha
    (tmp_path / "training_core" / "loop.py").write_text("steps = 2\n")
    edited = code_version(tmp_path)
    assert edited.startswith(f"{sha}-dirty-")
    (tmp_path / "training_core" / "order.py").write_text("")  # a module never `git add`ed is code too
    assert code_version(tmp_path) not in (sha, edited)
