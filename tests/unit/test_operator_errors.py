"""What an operator sees when the state around a run is wrong: one line naming the thing at fault
and the documented exit code, never a traceback or a silently wrong result. Covers the code
version of a tree with files git does not track yet, a damaged MLflow store and unexpected errors
under `tessera reproduce` (exit 1 is "metrics differ", so neither may exit 1), SQLite tracking URIs
that would lose every run, a deleted MLflow run given to reproduce, a state folder that is a file
(`python -m pipelines.instance`, the MLflow resource), a damaged dagster.yaml under
`tessera free-slots`, and a CSV field longer than the csv module's default limit.

Real components throughout: git in a temporary repository, a SQLite MLflow store, the `mlflow`
CLI, Dagster's instance loading and the demo tokenizer."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from training_core.errors import ConfigError, LineageError, SourceDataError

RUN_ID = "0123456789abcdef0123456789abcdef"


# --- code version -----------------------------------------------------------------------------


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_code_version_counts_files_git_does_not_track_yet_and_leaves_ignored_ones_out(tmp_path):
    from training_core.lineage import code_version

    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "training_core").mkdir()  # code is Python in Tessera's packages (lineage.CODE_PACKAGES)
    (repo / "training_core" / "train.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("state/\n")
    _git(repo, "add", "training_core/train.py", ".gitignore")
    _git(repo, "-c", "user.email=t@example.com", "-c", "user.name=t", "commit", "-qm", "init")
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                         check=True).stdout.strip()

    (repo / "state").mkdir()  # ignored (as .tessera/ and .venv are): not code
    (repo / "state" / "run.log").write_text("anything")
    assert code_version(repo) == sha

    # A new module never `git add`ed: a run with other code must not look like the committed one.
    (repo / "training_core" / "scale.py").write_text("LEARNING_RATE_SCALE = 1.0\n")
    first = code_version(repo)
    assert first.startswith(f"{sha}-dirty-")
    (repo / "training_core" / "scale.py").write_text("LEARNING_RATE_SCALE = 10.0\n")
    second = code_version(repo)
    assert second.startswith(f"{sha}-dirty-") and second != first
    assert code_version(repo) == second  # deterministic: a relaunch of the same tree reuses its run

    (repo / "training_core" / "scale.py").unlink()
    assert code_version(repo) == sha


def test_code_version_outside_a_git_checkout_hashes_the_sources_an_image_holds(tmp_path, monkeypatch):
    from training_core.lineage import CODE_VERSION_ENV, code_version, installed_version

    # A container image: the sources copied without .git, as deploy/Dockerfile does.
    image = tmp_path / "app"
    (image / "training_core").mkdir(parents=True)
    (image / "pyproject.toml").write_text("[project]\nname = 'tessera'\n")
    module = image / "training_core" / "loop.py"
    module.write_text("LEARNING_RATE_SCALE = 1.0\n")
    (image / "README.md").write_text("not code")
    monkeypatch.delenv(CODE_VERSION_ENV, raising=False)

    first = code_version(image)
    assert re.fullmatch(rf"tessera=={re.escape(installed_version('tessera'))}\+src-[0-9a-f]{{12}}", first)
    assert code_version(image) == first  # every pod running the image agrees
    (image / "README.md").write_text("other words")
    assert code_version(image) == first  # only code counts
    module.write_text("LEARNING_RATE_SCALE = 10.0\n")  # same package version, other code
    second = code_version(image)
    assert second != first

    monkeypatch.setenv(CODE_VERSION_ENV, "0123abc")  # the build argument: the sha it was built from
    assert code_version(image) == "0123abc+src-" + second.rsplit("+src-", 1)[1]
    monkeypatch.setenv(CODE_VERSION_ENV, "release 'one'")  # would break the MLflow search for reusable runs
    with pytest.raises(ConfigError, match=r"TESSERA_CODE_VERSION=\"release 'one'\": a code version label is a git sha"):
        code_version(image)


# --- tessera reproduce: exit 2 when it cannot reproduce, whatever the cause ---------------------


def test_reproduce_with_a_damaged_mlflow_store_names_the_store_and_exits_2(tmp_path, monkeypatch, capsys):
    from pipelines.cli import main

    # A home path longer than any terminal is wide: the path must still come out whole, unfolded.
    home = tmp_path / ("a-home-folder-with-a-long-name-" * 4)
    home.mkdir()
    monkeypatch.setenv("TESSERA_HOME", str(home))  # restored after the test: the command sets it
    (home / "mlflow.db").write_text("junk\n")
    assert main(["reproduce", RUN_ID, "--home", str(home)]) == 2
    captured = capsys.readouterr()
    assert captured.out.startswith(f"cannot reproduce: cannot open the MLflow tracking store {home / 'mlflow.db'}: "
                                   "(sqlite3.DatabaseError) file is not a database")
    assert len(captured.out.strip().splitlines()) == 1
    assert "Traceback" not in captured.out + captured.err


def test_an_unexpected_error_in_reproduce_exits_2_not_1_which_means_metrics_differ(tmp_path, monkeypatch, capsys):
    import pipelines.reproduce
    from pipelines.cli import main

    def fails_unexpectedly(run_id, console, tracking_uri=None):
        raise RuntimeError("worker group lost\nsecond line of detail")

    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    monkeypatch.setattr(pipelines.reproduce, "reproduce_run", fails_unexpectedly)
    assert main(["reproduce", RUN_ID, "--home", str(tmp_path)]) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line == f"tessera reproduce: could not reproduce run {RUN_ID}: RuntimeError: worker group lost"


def test_reproduce_refuses_a_deleted_run_and_says_how_to_restore_it(tmp_path):
    from training_core.reproduce import load_recorded_run
    from training_core.tracking import MlflowTracking

    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    run_id = tracking.start_run("train-test", tags={})
    tracking.end_run(run_id, status="FINISHED")
    tracking.client.delete_run(run_id)

    with pytest.raises(LineageError) as refused:
        load_recorded_run(tracking, run_id, cache_directory=None)
    message = str(refused.value)
    assert message.startswith(f"MLflow run {run_id} is deleted; restore it first with `")

    # The command it names restores the run: reproduce then goes on (to refuse this bare run for
    # the lineage it lacks).
    command = message.split("`")[1]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", "-c", command], check=True, capture_output=True, env=env, timeout=120)
    assert tracking.client.get_run(run_id).info.lifecycle_stage == "active"
    with pytest.raises(LineageError, match=f"run {run_id} lacks lineage params"):
        load_recorded_run(tracking, run_id, cache_directory=None)


# --- MLflow tracking URI and store folder -------------------------------------------------------


@pytest.mark.parametrize(("uri", "problem"), [
    ("sqlite://", "names no database file, so SQLite would keep every run in memory"),
    ("sqlite:///", "names no database file, so SQLite would keep every run in memory"),
    ("sqlite:/data/mlflow.db", "is not a SQLite URL MLflow can open"),
])
def test_sqlite_tracking_uris_that_name_no_file_are_refused(tmp_path, uri, problem):
    from resources import MlflowTracker, TesseraStorage

    tracker = MlflowTracker(storage=TesseraStorage(home=str(tmp_path)), tracking_uri=uri)
    with pytest.raises(ConfigError, match=re.escape(f"mlflow_tracker.tracking_uri {uri!r}: {problem}") +
                       r".*; use sqlite:///<file path>"):
        tracker.client()
    assert not (tmp_path / "mlartifacts").exists()  # refused before anything was created


def test_mlflow_tracker_with_a_state_folder_that_is_a_file_gives_the_storage_config_error(tmp_path, monkeypatch):
    from pipelines.resources_local import local_resources

    blocker = tmp_path / "home"
    blocker.write_text("")
    monkeypatch.setenv("TESSERA_HOME", str(blocker))
    with pytest.raises(ConfigError, match=re.escape(f"state folder {blocker} (storage.home / TESSERA_HOME) "
                                                    f"is not usable: cannot create {blocker / 'mlartifacts'}")):
        local_resources()["mlflow_tracker"].client()


@pytest.mark.parametrize("name", ["runs?v2", "team%41"])
def test_a_state_folder_whose_path_a_sqlite_url_would_misread_is_refused_before_anything_is_written(
        tmp_path, monkeypatch, name):
    # sqlite:///…/runs?v2/mlflow.db opened …/runs (outside the folder); …/team%41/… opened …/teamA/…
    from pipelines.resources_local import local_resources

    home = tmp_path / name
    monkeypatch.setenv("TESSERA_HOME", str(home))
    special = "'?'" if "?" in name else "'%'"
    with pytest.raises(ConfigError, match=re.escape(f"state folder {home} (storage.home / TESSERA_HOME / --home): "
                                                    f"its path holds {special}")):
        local_resources()["mlflow_tracker"].client()
    done = subprocess.run([sys.executable, "-m", "pipelines.instance", str(home)], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 2 and f"state folder {home} (storage.home" in done.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == []  # no database beside it, no folder


# --- the Dagster instance -----------------------------------------------------------------------


def test_preparing_an_instance_in_a_file_prints_one_line_and_exits_2(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = subprocess.run([sys.executable, "-m", "pipelines.instance", str(blocker)], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 2
    assert done.stderr.strip() == (f"python -m pipelines.instance: state folder {blocker} is not usable: "
                                   "Not a directory")


def test_preparing_an_instance_refuses_a_damaged_dagster_yaml_and_a_flag_for_a_folder(tmp_path):
    # `make ui` runs it before `dagster dev`: a damaged settings file is named here, in one line.
    repo = Path(__file__).resolve().parents[2]
    settings = tmp_path / "home" / "dagster" / "dagster.yaml"
    settings.parent.mkdir(parents=True)
    settings.write_text("telemetry: [\n  bad")
    done = subprocess.run([sys.executable, "-m", "pipelines.instance", str(tmp_path / "home")], capture_output=True,
                          text=True, timeout=120, cwd=repo)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"python -m pipelines.instance: {settings}: not valid YAML at line 2")
    assert len(done.stderr.strip().splitlines()) == 1

    helped = subprocess.run([sys.executable, "-m", "pipelines.instance", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(repo)})
    assert helped.returncode == 0 and helped.stdout.startswith("usage: python -m pipelines.instance")
    assert not (tmp_path / "--help").exists()  # not taken for a state folder to create
    refused = subprocess.run([sys.executable, "-m", "pipelines.instance", "--home"], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(repo)})
    assert refused.returncode == 2 and "unexpected arguments ['--home']" in refused.stderr
    assert not (tmp_path / "--home").exists()


@pytest.mark.parametrize(("settings", "message"), [
    ("concurrency: [oops\n", "{file}: not valid YAML at line 2, column 1 (expected ',' or ']'"),
    ("telemetry:\n  enabled: nope\n", "{file}: not a valid Dagster instance config (Invalid scalar at path "
                                      "root:telemetry:enabled."),
    ("concurrency: 5\n", "cannot load the Dagster instance in {folder}: TypeError: "),  # Dagster's bare TypeError
])
def test_free_slots_with_a_damaged_dagster_yaml_names_the_file_in_one_line(tmp_path, monkeypatch, capsys,
                                                                          settings, message):
    from pipelines.cli import main

    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))  # the command exports both
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    settings_file = tmp_path / "dagster" / "dagster.yaml"
    settings_file.parent.mkdir()
    settings_file.write_text(settings)
    assert main(["free-slots", "--home", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("tessera free-slots: " + message.format(file=settings_file, folder=settings_file.parent))
    assert len(error.strip().splitlines()) == 1 and str(settings_file) in error


# --- source records -----------------------------------------------------------------------------


def test_a_csv_field_longer_than_the_csv_modules_default_limit_is_read_and_named_where_too_long(tmp_path, demo_model):
    from training_core.base_model import load_tokenizer
    from training_core.data.dataset_writer import DatasetSpec, write_dataset
    from training_core.data.frozen_records import freeze_records
    from tests.unit.source_support import read_records_with_origins

    long_prompt = "x " * 70_000  # 140 000 characters: over csv's 131 072, valid CSV all the same
    source = tmp_path / "long.csv"
    with source.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerows([["prompt", "response"], ["encode: a b", "d e"], [long_prompt, "y"]])
    records, origins = read_records_with_origins(source)
    assert records[1] == {"prompt": long_prompt, "response": "y"}
    assert origins.describe(1) == f"line 3 of {source}"

    # Too long to train on: refused as any over-long record is, naming both files and lines.
    frozen = freeze_records(records, origins, tmp_path / "raw")  # as raw_examples freezes them
    out = tmp_path / "out"
    out.mkdir()
    where = rf"p: line 2 of .*records\.jsonl, from line 3 of {re.escape(str(source))} "
    with pytest.raises(SourceDataError, match=where + r"\(prompt 'x x x .*\): \d+ tokens do not fit seq_len=64"):
        write_dataset(records, load_tokenizer(demo_model.name_or_path), out, DatasetSpec(), source_label="p",
                      records_path=str(frozen.path))


def test_an_untracked_file_larger_than_any_source_file_counts_by_size_and_mtime_not_by_reading_it(tmp_path):
    # Someone's data export left in the checkout must not make every training launch read it.
    from training_core import lineage

    big = tmp_path / "export.parquet"
    with big.open("wb") as handle:
        handle.truncate(lineage._LARGEST_HASHED_FILE + 1)  # sparse: no disk used
    first = lineage._file_digest(big)
    os.utime(big, ns=(1, 1))
    assert lineage._file_digest(big) != first  # touched (rewritten): another code version
    small = tmp_path / "module.py"
    small.write_text("x = 1\n")
    os.utime(small, ns=(1, 1))
    before = lineage._file_digest(small)
    os.utime(small, ns=(2, 2))
    assert lineage._file_digest(small) == before  # source files count by content


# --- a state folder moved after it was created ---------------------------------------------------------


def test_a_moved_state_folder_is_refused_before_anything_writes_to_its_old_path(tmp_path):
    """MLflow, the lineage and Dagster's step values hold absolute paths into the state folder: after
    a move, runs would write artifacts under the old path again and the champion could not be loaded."""
    from pipelines.instance import prepare_home
    from resources import MlflowTracker, TesseraStorage

    created, moved = tmp_path / "created", tmp_path / "moved"
    MlflowTracker(storage=TesseraStorage(home=str(created))).client()  # the experiment names created/mlartifacts
    created.rename(moved)
    message = re.escape(f"state folder {moved} (storage.home / TESSERA_HOME) was created at {created} and has "
                        "been moved or copied since")
    with pytest.raises(ConfigError, match=message):
        MlflowTracker(storage=TesseraStorage(home=str(moved))).client()
    with pytest.raises(ConfigError, match=message):
        TesseraStorage(home=str(moved)).folder("datasets")
    with pytest.raises(ConfigError, match=re.escape(f"was created at {created}")):
        prepare_home(str(moved))  # `make ui`, `tessera demo`: before Dagster starts
    assert not created.exists()  # nothing recreated the old path
    created.symlink_to(moved)  # the documented way to keep using it from its new place
    assert MlflowTracker(storage=TesseraStorage(home=str(moved))).client().experiment_id


def test_an_mlflow_experiment_keeping_its_artifacts_elsewhere_is_refused(tmp_path):
    """Two deployments sharing one tracking database, or a folder moved by hand: new runs would
    write their artifacts outside this deployment's folder."""
    from training_core.tracking import MlflowTracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowTracking(uri, tmp_path / "first")
    with pytest.raises(ConfigError, match=re.escape(f"MLflow experiment 'tessera' keeps its artifacts in "
                                                    f"{tmp_path / 'first'}, not in this deployment's {tmp_path / 'second'}")):
        MlflowTracking(uri, tmp_path / "second")
    assert MlflowTracking(uri, tmp_path / "first").experiment_id  # the same folder: fine


def test_a_state_folder_whose_root_cannot_be_written_works_without_a_marker(tmp_path, monkeypatch):
    """A read-only volume root with writable subfolders worked before the marker existed: it still does."""
    import errno

    from resources import paths
    from resources.paths import HOME_MARKER, TesseraStorage

    def read_only(source, target):
        raise OSError(errno.EROFS, "Read-only file system", str(target))

    monkeypatch.setattr(paths.os, "replace", read_only)
    assert TesseraStorage(home=str(tmp_path)).folder("datasets") == tmp_path / "datasets"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["datasets"]  # no marker, no temporary file left
    monkeypatch.undo()
    TesseraStorage(home=str(tmp_path)).folder("datasets")
    assert (tmp_path / HOME_MARKER).read_text().strip() == str(tmp_path.resolve())


def test_an_mlflow_experiment_with_artifacts_inside_the_deployments_folder_is_accepted(tmp_path):
    """An experiment created in the MLflow UI of `make ui` keeps its artifacts in <root>/<id>."""
    from mlflow.tracking import MlflowClient

    from training_core.tracking import MlflowTracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).create_experiment("tessera", artifact_location=(tmp_path / "mlartifacts" / "1").as_uri())
    assert MlflowTracking(uri, tmp_path / "mlartifacts").experiment_id
