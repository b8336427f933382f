"""Hub base models are pinned to one commit: the base_model asset records it, and `tessera reproduce`
loads that commit after the hub's branch moved on, or refuses naming both commits. The hub is a
Hugging Face cache in the test's folder, read offline (HF_HUB_OFFLINE=1), as huggingface_hub lays it out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from training_core.base_model import resolve_pretrained
from training_core.errors import LineageError
from training_core.reproduce import load_recorded_run
from training_core.tracking import MlflowTracking

OLD, NEW = "a" * 40, "b" * 40


@pytest.fixture
def hub_cache(tmp_path: Path, demo_model, monkeypatch) -> Path:
    """`org/tiny` with two commits (NEW has another rms_norm_eps), its main branch at OLD."""
    import huggingface_hub.constants

    cache = tmp_path / "hf" / "hub"
    repo = cache / "models--org--tiny"
    for commit in (OLD, NEW):
        shutil.copytree(demo_model.name_or_path, repo / "snapshots" / commit)
    config = repo / "snapshots" / NEW / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "rms_norm_eps": 1e-3}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(OLD)
    for name, value in (("HF_HOME", str(tmp_path / "hf")), ("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    # huggingface_hub read the environment when it was imported
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return repo


def _move_main(repo: Path, commit: str) -> None:
    (repo / "refs" / "main").write_text(commit)


def test_a_hub_id_resolves_to_the_snapshot_of_the_commit_its_branch_is_at(hub_cache):
    ref = resolve_pretrained("org/tiny")
    assert ref.digest == f"hub:org/tiny@{OLD}" and ref.revision == OLD
    assert ref.name_or_path == str(hub_cache / "snapshots" / OLD)  # what training and evaluation load
    _move_main(hub_cache, NEW)
    assert resolve_pretrained("org/tiny").digest == f"hub:org/tiny@{NEW}"
    pinned = resolve_pretrained(f"org/tiny@{OLD}")  # a revision in the id pins it
    assert (pinned.digest, pinned.name_or_path) == (f"hub:org/tiny@{OLD}", str(hub_cache / "snapshots" / OLD))


def test_a_hub_id_not_in_the_cache_offline_is_named(hub_cache):
    from training_core.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError,
                       match=r"base model org/other .*read as a Hugging Face Hub id\): cannot be had"):
        resolve_pretrained("org/other")


def _record_hub_run(tmp_path: Path, base_model: str, base_model_digest: str) -> tuple[MlflowTracking, str]:
    from tests.unit.test_reproduce_inputs import _published_dataset, _record_run

    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    dataset = _published_dataset(tmp_path / "datasets" / "2026-11-01")
    run_id = _record_run(tracking, tmp_path, [dataset],
                         overrides={"base_model": base_model, "base_model_digest": base_model_digest})
    return tracking, run_id


def test_reproduce_loads_the_recorded_commit_after_the_branch_moved_and_refuses_when_it_is_gone(hub_cache, tmp_path):
    ref = resolve_pretrained("org/tiny")
    tracking, run_id = _record_hub_run(tmp_path, ref.name_or_path, ref.digest)
    _move_main(hub_cache, NEW)

    inputs = load_recorded_run(tracking, run_id, None).inputs
    assert (inputs.base_model, inputs.base_model_digest) == (str(hub_cache / "snapshots" / OLD), f"hub:org/tiny@{OLD}")

    shutil.rmtree(hub_cache / "snapshots" / OLD)  # the cache was cleaned, and offline it cannot come back
    with pytest.raises(LineageError) as refused:
        load_recorded_run(tracking, run_id, None)
    message = str(refused.value)
    assert f"run {run_id}: base model org/tiny at its recorded revision {OLD} cannot be had" in message
    assert f"its main branch is at {NEW} now" in message


def test_a_hub_run_recorded_without_its_revision_is_refused(hub_cache, tmp_path):
    tracking, run_id = _record_hub_run(tmp_path, "org/tiny", "hub:org/tiny@None")  # before revisions were pinned
    with pytest.raises(LineageError, match=rf"run {run_id}: its base model org/tiny is a hub model recorded without "
                                           rf"its revision .*its main branch is at {OLD} now\), so which weights"):
        load_recorded_run(tracking, run_id, None)
