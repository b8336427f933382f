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
    assert ref.digest == f"hub:org/tiny@{OLD}" and Path(ref.name_or_path).name == OLD
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


def test_a_snapshot_folder_names_its_hub_repo_and_commit(tmp_path):
    from training_core.base_model import HubRevision, hub_revision_of_snapshot

    hub = tmp_path / "hf" / "hub"
    assert hub_revision_of_snapshot(hub / "models--org--tiny" / "snapshots" / OLD) == HubRevision("org/tiny", OLD)
    assert hub_revision_of_snapshot(str(hub / "models--gpt2" / "snapshots" / OLD)) == HubRevision("gpt2", OLD)
    for other in (tmp_path / "models--org--tiny" / "snapshots" / "main",  # a branch name, not a commit
                  tmp_path / "datasets--org--tiny" / "snapshots" / OLD, tmp_path / "org" / "tiny", Path("org/tiny")):
        assert hub_revision_of_snapshot(other) is None


def test_an_adapter_over_a_hub_snapshot_names_the_repo_and_commit_not_this_machines_cache(hub_cache, tmp_path):
    from training_core.train.config import TrainingConfig
    from training_core.train.loop import finish_adapter_config
    from training_core.train.model_setup import apply_method, load_base_model

    ref = resolve_pretrained("org/tiny")
    config = TrainingConfig()
    apply_method(load_base_model(config, ref.name_or_path), config).save_pretrained(tmp_path / "adapter")
    finish_adapter_config(tmp_path / "adapter")

    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (adapter_config["base_model_name_or_path"], adapter_config["revision"]) == ("org/tiny", OLD)
    assert adapter_config["target_modules"] == sorted(adapter_config["target_modules"])
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert "base_model: org/tiny" in card and str(hub_cache) not in card


def test_a_champions_hub_base_model_is_fetched_again_when_its_recorded_snapshot_is_not_here(hub_cache, tmp_path):
    from training_core.registry import ModelRegistry

    trained_on = "/elsewhere/hf/hub/models--org--tiny/snapshots/" + OLD  # another machine's or HF_HOME's cache
    from tests.unit.test_mlflow_tracking import log_adapter_files

    tracking, run_id = _record_hub_run(tmp_path, trained_on, f"hub:org/tiny@{OLD}")
    log_adapter_files(tracking, run_id, tmp_path / "adapter")
    registry = ModelRegistry(tracking, "adapter", "champion")
    registry.promote(run_id)
    assert registry.base_model_of(registry.champion()) == str(hub_cache / "snapshots" / OLD)

    shutil.rmtree(hub_cache / "snapshots" / OLD)  # and offline it cannot come back
    with pytest.raises(LineageError, match=rf"run {run_id}\), alias 'champion': its base model org/tiny at commit "
                                           rf"{OLD} cannot be loaded: not at the recorded {trained_on}, and not"):
        registry.base_model_of(registry.champion())


MISTRAL_LIKE_REPO = ["config.json", "consolidated.safetensors", "model-00001-of-00002.safetensors",
                     "model-00002-of-00002.safetensors", "model.safetensors.index.json", "params.json",
                     "pytorch_model.bin", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]


def test_only_the_weights_from_pretrained_loads_are_chosen(tmp_path):
    from training_core.base_model import hub_weight_files

    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors",
                                            "c": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert hub_weight_files(tmp_path, "model.safetensors.index.json", "model.safetensors") == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert hub_weight_files(tmp_path, "pytorch_model.bin.index.json", "pytorch_model.bin") == ["pytorch_model.bin"]
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: not a weights index with a weight_map"):
        hub_weight_files(tmp_path, "model.safetensors.index.json", "model.safetensors")


@pytest.mark.parametrize("repo_files, downloaded", [
    (MISTRAL_LIKE_REPO, ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                         "model.safetensors.index.json", "params.json", "tokenizer.json", "tokenizer.model",
                         "tokenizer_config.json"]),
    (["config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json"],
     ["config.json", "model.safetensors", "tokenizer.json"]),
    (["config.json", "pytorch_model.bin", "tf_model.h5", "tokenizer.json"],  # an older repo: no safetensors
     ["config.json", "pytorch_model.bin", "tokenizer.json"]),
], ids=["sharded with a consolidated copy", "single file and a .bin copy", "bin only"])
def test_a_hub_snapshot_downloads_one_copy_of_the_weights(tmp_path, monkeypatch, repo_files, downloaded):
    """The hub, as snapshot_download serves it: the files of one commit that allow_patterns select."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from training_core.base_model import hub_snapshot

    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}

    def snapshot_download(repo_id, revision, allow_patterns):
        folder = tmp_path / "snapshots" / OLD
        folder.mkdir(parents=True, exist_ok=True)
        for name in filter_repo_objects(repo_files, allow_patterns=allow_patterns):
            (folder / name).write_text(json.dumps(index) if name == "model.safetensors.index.json" else name)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert sorted(p.name for p in hub_snapshot("org/tiny").iterdir()) == downloaded
