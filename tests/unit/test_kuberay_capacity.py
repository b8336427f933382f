"""A worker group against the KubeRay RayCluster of deploy/kuberay/raycluster.yaml: larger than its
worker groups at maxReplicas can ever hold, it is refused before any worker starts (Ray Train would
retry its start-up for ever); within that, training and `tessera reproduce` alike wait for the
autoscaler, whatever the cluster holds at rest.

The ceiling comes from the real manifest through the Ray autoscaler's own reading of it; only what the
live cluster reports (`ray.nodes()`, its GPUs) is faked."""

from __future__ import annotations

import copy
import logging
from io import StringIO

import pytest
import ray
import yaml
from rich.console import Console

from pipelines import reproduce
from resources.kuberay_cluster import kuberay_cluster_from_manifest
from resources.ray_cluster import ExternalRayCluster, check_cluster_capacity
from tests.unit.deploy_support import RAY_MANIFEST
from tests.unit.test_reproduce_wiring import _recorded_run, _Trained, home  # noqa: F401 - home is a fixture
from training_core.errors import ConfigError
from training_core.train.config import TrainingConfig

(GPU_GROUP,) = RAY_MANIFEST["spec"]["workerGroupSpecs"]
MAX_GPU_PODS = GPU_GROUP["maxReplicas"]
CEILING = (f"RayCluster {RAY_MANIFEST['metadata']['name']} (worker group {GPU_GROUP['groupName']}: "
           f"maxReplicas {MAX_GPU_PODS} × 8 CPU, 1 GPU per pod; head: 0 CPU, 0 GPU)")
# docs/scaling_out.md's address for reproduce on the attached cluster
HEAD_SERVICE = (f"ray://{RAY_MANIFEST['metadata']['name']}-head-svc."
                f"{RAY_MANIFEST['metadata']['namespace']}.svc.cluster.local:10001")


@pytest.fixture
def cluster_at_rest(monkeypatch):
    """`ray.nodes()` of the shipped cluster at minReplicas: the head (num-cpus 0) and one GPU pod."""
    nodes = [{"CPU": 0.0, "memory": 8e9}, {"CPU": 8.0, "GPU": 1.0, "memory": 48e9}]
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": node} for node in nodes])


def _gpu_run(num_workers: int) -> TrainingConfig:
    return TrainingConfig(num_workers=num_workers, use_gpu=True, precision="bf16")


def test_a_worker_group_larger_than_the_raycluster_at_max_replicas_is_refused_naming_it(cluster_at_rest):
    beyond = MAX_GPU_PODS + 1
    with pytest.raises(ConfigError) as refused:
        check_cluster_capacity(_gpu_run(beyond), kuberay_cluster_from_manifest(), logging.getLogger("test"))
    assert str(refused.value) == (
        f"num_workers={beyond} with use_gpu=True can never run on {CEILING}, even at its largest: "
        f"num_workers={beyond} × 1 GPU per worker needs {beyond} GPU, and the Ray cluster has {MAX_GPU_PODS} in all; "
        "lower num_workers, or train on a larger cluster")


def test_a_worker_group_the_autoscaler_can_reach_is_waited_for_by_training_and_by_reproduce(
        cluster_at_rest, home, monkeypatch, caplog):  # noqa: F811 - the fixture imported above
    config = _gpu_run(2)  # more than the one GPU up at rest, within the four at maxReplicas
    with caplog.at_level(logging.WARNING, logger="test"):
        check_cluster_capacity(config, kuberay_cluster_from_manifest(), logging.getLogger("test"))
    assert [record.getMessage() for record in caplog.records] == [
        "num_workers=2 × 1 GPU per worker needs 2 GPU, and the Ray cluster has 1 in all; lower num_workers, or "
        f"train on a larger cluster; waiting for nodes to join: {CEILING} holds the worker group at its largest"]

    # reproduce in a pod of the deployment, pointed at the attached cluster as docs/scaling_out.md says
    monkeypatch.setenv("TESSERA_RAY_ADDRESS", HEAD_SERVICE)
    run_id, _ = _recorded_run(home, config=config)
    monkeypatch.setattr(reproduce, "_connect_to_ray", lambda ray_cluster: None)
    monkeypatch.setattr(reproduce, "gpu_available_in_cluster", lambda: True)
    trained = []

    def record(config, *args, **kwargs):
        trained.append(config)
        raise _Trained

    monkeypatch.setattr(reproduce, "run_tracked_training", record)
    output = StringIO()
    with pytest.raises(_Trained):
        reproduce.reproduce_run(run_id, Console(file=output, soft_wrap=True))
    assert [run.num_workers for run in trained] == [2]
    assert f"waiting for nodes to join: {CEILING} holds the worker group at its largest" in output.getvalue()


def test_reproduce_refuses_a_run_the_attached_raycluster_can_never_hold(
        cluster_at_rest, home, monkeypatch):  # noqa: F811 - the fixture imported above
    monkeypatch.setenv("TESSERA_RAY_ADDRESS", HEAD_SERVICE)
    run_id, _ = _recorded_run(home, config=_gpu_run(MAX_GPU_PODS * 2))
    monkeypatch.setattr(reproduce, "_connect_to_ray", lambda ray_cluster: None)
    monkeypatch.setattr(reproduce, "gpu_available_in_cluster", lambda: True)
    output = StringIO()
    assert reproduce.reproduce_run(run_id, Console(file=output, soft_wrap=True)) == 2
    assert (f"cannot reproduce: num_workers={MAX_GPU_PODS * 2} with use_gpu=True can never run on {CEILING}, "
            "even at its largest") in output.getvalue()


@pytest.mark.parametrize("address", [HEAD_SERVICE, f"{RAY_MANIFEST['metadata']['name']}-head-svc:6379"],
                         ids=["ray client, full name", "gcs, short name"])
def test_an_external_cluster_at_the_manifests_head_service_has_the_manifests_ceiling(address):
    ceiling = ExternalRayCluster(address=address).capacity_ceiling
    assert ceiling.where == CEILING
    assert ceiling.nodes == kuberay_cluster_from_manifest().capacity_ceiling.nodes


@pytest.mark.parametrize("address", ["10.0.0.5:6379", "auto", "ray://other-ray-head-svc.tessera.svc:10001",
                                     "ray://tessera-ray-head-svc.staging.svc.cluster.local:10001"],
                         ids=["ip", "auto", "another raycluster", "another namespace"])
def test_other_external_clusters_have_no_known_ceiling(address):
    assert ExternalRayCluster(address=address).capacity_ceiling is None


def _manifest_with(tmp_path, change) -> str:
    manifest = copy.deepcopy(RAY_MANIFEST)
    change(manifest["spec"])
    path = tmp_path / "raycluster.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return str(path)


def test_the_ceiling_counts_a_head_that_takes_work_and_every_host_of_a_replica(tmp_path):
    def head_works_and_two_hosts(spec):
        del spec["headGroupSpec"]["rayStartParams"]["num-cpus"]  # the head's 2-CPU limit becomes Ray's
        spec["workerGroupSpecs"][0]["numOfHosts"] = 2

    ceiling = kuberay_cluster_from_manifest(_manifest_with(tmp_path, head_works_and_two_hosts)).capacity_ceiling
    assert sum(node["CPU"] for node in ceiling.nodes) == 2 + MAX_GPU_PODS * 2 * 8
    assert sum(node.get("GPU", 0.0) for node in ceiling.nodes) == MAX_GPU_PODS * 2
    assert f"maxReplicas {MAX_GPU_PODS} × 2 hosts × 8 CPU, 1 GPU per pod; head: 2 CPU, 0 GPU" in ceiling.where


def test_a_worker_group_without_max_replicas_sets_no_ceiling(tmp_path, cluster_at_rest, caplog):
    path = _manifest_with(tmp_path, lambda spec: spec["workerGroupSpecs"][0].pop("maxReplicas"))
    cluster = kuberay_cluster_from_manifest(path)
    assert cluster.capacity_ceiling is None  # Kubernetes defaults it to 2^31 - 1
    with caplog.at_level(logging.WARNING, logger="test"):
        check_cluster_capacity(_gpu_run(64), cluster, logging.getLogger("test"))  # only the autoscaler can tell
    assert caplog.records[0].getMessage().endswith("waiting for the cluster's autoscaler to add nodes")


def test_a_cluster_already_larger_than_the_images_manifest_is_waited_for(monkeypatch, caplog):
    # The RayCluster was applied from an operator's checkout with more replicas than the image's copy names.
    nodes = [{"CPU": 0.0}] + [{"CPU": 8.0, "GPU": 1.0}] * (MAX_GPU_PODS + 2)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": node} for node in nodes])
    with caplog.at_level(logging.WARNING):
        check_cluster_capacity(_gpu_run(MAX_GPU_PODS + 4), kuberay_cluster_from_manifest(), logging.getLogger("test"))
    assert f"the cluster already holds more than {CEILING} at its largest" in caplog.text


def test_a_cluster_already_at_its_largest_refuses_a_larger_worker_group(monkeypatch):
    # Every GPU pod up (at maxReplicas): more workers than that can never be placed, so no waiting.
    nodes = [{"CPU": 0.0}] + [{"CPU": 8.0, "GPU": 1.0}] * MAX_GPU_PODS
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": node} for node in nodes])
    with pytest.raises(ConfigError, match="can never run on"):
        check_cluster_capacity(_gpu_run(MAX_GPU_PODS + 1), kuberay_cluster_from_manifest(), logging.getLogger("test"))


def test_without_the_autoscaler_the_ceiling_is_replicas_not_max_replicas(tmp_path, cluster_at_rest):
    def no_autoscaler(spec):
        spec["enableInTreeAutoscaling"] = False
        spec["workerGroupSpecs"][0]["replicas"] = 1

    cluster = kuberay_cluster_from_manifest(_manifest_with(tmp_path, no_autoscaler))
    assert sum(node.get("GPU", 0.0) for node in cluster.capacity_ceiling.nodes) == 1
    with pytest.raises(ConfigError, match=rf"\(worker group {GPU_GROUP['groupName']}: replicas 1 × 8 CPU"):
        check_cluster_capacity(_gpu_run(2), cluster, logging.getLogger("test"))  # nothing would ever add a pod
