"""The storage resource's Ray Train storage (`storage.ray_storage_uri`, `TESSERA_RAY_STORAGE` on
Kubernetes): only an absolute path is accepted, refused when the resource is built, naming the
setting, instead of Ray Train failing on a mangled path after Ray has started."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from pydantic import ValidationError

from resources import TesseraStorage


@pytest.mark.parametrize("value", ["s3://my-bucket/tessera/ray", "file:///var/lib/tessera/ray", "relative/ray", ""],
                         ids=["object store", "file URI", "relative path", "empty"])
def test_ray_storage_other_than_an_absolute_path_is_refused_naming_the_setting(tmp_path, value):
    with pytest.raises(ValidationError) as refused:
        TesseraStorage(home=str(tmp_path), ray_storage_uri=value)
    message = str(refused.value)
    setting = "storage.ray_storage_uri (TESSERA_RAY_STORAGE on Kubernetes)"
    assert f"{setting} {value!r}: expected an absolute path" in message
    assert "at the same path on every node" in message


def test_an_absolute_ray_storage_path_is_used_as_given_and_the_default_is_under_the_state_folder(tmp_path):
    shared = tmp_path / "shared" / "ray"
    assert TesseraStorage(home=str(tmp_path), ray_storage_uri=f"{shared}/").ray_storage == str(shared)
    assert TesseraStorage(home=str(tmp_path), ray_storage_uri="~/ray").ray_storage == str(Path.home() / "ray")
    assert TesseraStorage(home=str(tmp_path)).ray_storage == str(tmp_path / "ray")


def test_the_kubernetes_location_refuses_an_object_store_ray_storage_when_a_run_starts(tmp_path, monkeypatch):
    from pipelines.resources_kubernetes import kubernetes_resources

    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    monkeypatch.setenv("TESSERA_RAY_STORAGE", "s3://my-bucket/tessera/ray")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    storage = kubernetes_resources()["storage"]  # the definitions load: the variable is read at launch

    @dg.asset
    def trains(storage: TesseraStorage) -> None:
        pass

    with pytest.raises(dg.DagsterResourceFunctionError) as refused:  # before the step, so before Ray
        dg.materialize([trains], resources={"storage": storage})
    assert ("storage.ray_storage_uri (TESSERA_RAY_STORAGE on Kubernetes) 's3://my-bucket/tessera/ray': expected an "
            "absolute path") in str(refused.value.user_exception)
