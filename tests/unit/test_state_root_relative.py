"""A relative state folder ($TESSERA_HOME, storage.home, --home) means the folder under the directory
Tessera was started in, and is kept as that absolute path: Dagster's run workers, Ray's workers and
the SQLite URLs of MLflow's store start elsewhere or read paths on their own terms."""

from __future__ import annotations

from resources.paths import state_root


def test_a_relative_state_folder_is_the_absolute_folder_it_names_where_tessera_started(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TESSERA_HOME", "state")
    from_environment, given = state_root(None), state_root("runs/../given")
    assert from_environment == tmp_path.resolve() / "state"
    assert given == tmp_path.resolve() / "given"
    monkeypatch.chdir("/")  # a worker started elsewhere still finds the same folders
    assert from_environment.is_absolute() and given.is_absolute()
