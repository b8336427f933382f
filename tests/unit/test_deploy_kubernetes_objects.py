"""Offline checks of the Kubernetes objects in deploy/: no cluster, no Helm, no Docker.

Every YAML file parses; Kubernetes objects go through dagster-k8s's strict deserializer (unknown keys
rejected at every level, required fields enforced by the `kubernetes` client models); the RayCluster
goes through dagster-ray's own pydantic config models; `kuberay_cluster_from_manifest` builds the
dagster-ray resource from it.
"""

from __future__ import annotations

import ast
import copy
import inspect
import logging
import re
import sys
import types
from importlib.metadata import version
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster_ray import RayResource

from deploy.k8s_executor import EXECUTOR_NAME, tessera_k8s_executor
from deploy.k8s_tags import GPU_RESOURCE, GPU_TOLERATIONS, TRAINING_ASSET
from resources.kuberay_cluster import (
    KubeRayManifestError,
    kuberay_cluster_from_manifest,
    raycluster_config_from_manifest,
)
from tests.unit.deploy_support import (
    CONFIG_MAP,
    DEPLOY,
    DOCKERFILE,
    HELM_VALUES,
    IMAGE_GID,
    K8S_OBJECTS,
    NAMESPACE,
    RAY_MANIFEST,
    RAYCLUSTER,
    STATE_PVC,
    YAML_FILES,
    _documents,
    _k8s_model_name,
    _ray_groups,
    _strict_k8s,
)


# --- every file parses, every Kubernetes object is a valid object ---------------------------------


def test_deploy_folder_holds_the_expected_manifests():
    names = {str(path.relative_to(DEPLOY)) for path in YAML_FILES}
    assert {"dagster/values.yaml", "kuberay/raycluster.yaml", "kuberay/rbac.yaml", "shared-state.yaml"} <= names


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses_into_mappings(path):
    documents = _documents(path)
    assert documents, f"{path} is empty"
    assert all(isinstance(doc, dict) for doc in documents)


@pytest.mark.parametrize(
    "path,doc", [(p, d) for p, d in K8S_OBJECTS if d["kind"] != "RayCluster"],
    ids=lambda value: value["kind"] if isinstance(value, dict) else value.name,
)
def test_kubernetes_objects_deserialize_strictly(path, doc):
    model = _strict_k8s(_k8s_model_name(doc), doc)
    assert model.metadata.name
    assert model.metadata.namespace == NAMESPACE


def test_strict_deserializer_rejects_typos_and_missing_required_fields():
    with pytest.raises(Exception, match="mountpath"):
        _strict_k8s("V1VolumeMount", {"name": "x", "mountpath": "/data"})
    with pytest.raises(ValueError, match="name"):
        _strict_k8s("V1Container", {"image": "tessera:latest"})


# --- the RayCluster ------------------------------------------------------------------------------


def test_raycluster_spec_validates_with_dagster_ray_models_and_round_trips():
    config = raycluster_config_from_manifest(RAY_MANIFEST)
    rendered = config.to_k8s(types.SimpleNamespace(log=logging.getLogger(__name__)))
    # dagster-ray adds `env: []` to containers that have no env; nothing else may change.
    for group in _ray_groups(rendered):
        for container in group["template"]["spec"]["containers"]:
            if container.get("env") == []:
                del container["env"]
    assert rendered["apiVersion"] == "ray.io/v1" and rendered["kind"] == "RayCluster"
    assert rendered["spec"] == RAY_MANIFEST["spec"]


def test_dagster_ray_models_reject_an_invalid_spec():
    broken = copy.deepcopy(RAY_MANIFEST)
    broken["spec"]["authOptions"] = {"mode": "token"}  # token auth needs rayVersion >= 2.52
    broken["spec"]["rayVersion"] = "2.40.0"
    with pytest.raises(KubeRayManifestError, match="2.52"):
        raycluster_config_from_manifest(broken)


@pytest.mark.parametrize("group", _ray_groups(RAY_MANIFEST), ids=lambda g: g.get("groupName", "head"))
def test_ray_pod_templates_are_valid_pod_templates(group):
    template = _strict_k8s("V1PodTemplateSpec", group["template"])
    assert template.spec.containers
    # KubeRay passes rayStartParams to `ray start` as strings; numbers are rejected by the CRD.
    assert all(isinstance(value, str) for value in group["rayStartParams"].values())


def test_head_takes_no_work_and_no_gpu():
    head = RAY_MANIFEST["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    for container in head["template"]["spec"]["containers"]:
        resources = container.get("resources", {})
        assert GPU_RESOURCE not in {**resources.get("requests", {}), **resources.get("limits", {})}


def test_gpu_worker_group_autoscales_and_keeps_one_gpu_visible():
    spec = RAY_MANIFEST["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    (group,) = [g for g in spec["workerGroupSpecs"] if g["groupName"] == "gpu"]
    # lora_adapter checks ray.cluster_resources()["GPU"] > 0 before training: a group scaled to
    # zero would make that check fail, so at least one GPU worker stays.
    assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert group["maxReplicas"] > group["minReplicas"]
    (container,) = group["template"]["spec"]["containers"]
    assert container["image"] == "tessera:latest"
    assert container["resources"]["limits"][GPU_RESOURCE] == "1"


def test_ray_and_python_versions_match_the_image_and_the_environment():
    ray_version = version("ray")
    assert RAY_MANIFEST["spec"]["rayVersion"] == ray_version
    python_tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    base_image = re.search(r"^FROM (\S+)", DOCKERFILE.read_text(), re.MULTILINE).group(1)
    assert base_image == f"rayproject/ray:{ray_version}-{python_tag}-gpu"


def test_ray_pods_run_the_code_locations_image():
    """Ray Client needs the driver (a step pod, started from the code location's image) and the
    cluster on the same Python, Ray and Tessera code: one image, built from deploy/Dockerfile."""
    (deployment,) = HELM_VALUES["dagster-user-deployments"]["deployments"]
    code_location_image = f"{deployment['image']['repository']}:{deployment['image']['tag']}"
    images = {c["image"] for g in _ray_groups(RAY_MANIFEST) for c in g["template"]["spec"]["containers"]}
    assert images == {code_location_image}


def test_head_exposes_the_ray_client_port_dagster_ray_connects_to():
    """KubeRay names the head service's ports and `status.endpoints` after the container's port
    names; dagster-ray waits for `status.endpoints.dashboard` and connects to the `client` port."""
    cluster = kuberay_cluster_from_manifest(RAYCLUSTER)
    (head_container,) = RAY_MANIFEST["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in head_container["ports"]}
    assert ports == {"gcs-server": 6379, "dashboard": cluster.dashboard_port, "client": cluster.redis_port}


def test_gpu_worker_pods_tolerate_the_gpu_taint():
    gpu_groups = [g for g in RAY_MANIFEST["spec"]["workerGroupSpecs"]
                  if any(GPU_RESOURCE in c["resources"]["limits"] for c in g["template"]["spec"]["containers"])]
    assert gpu_groups
    for group in gpu_groups:
        tolerations = group["template"]["spec"].get("tolerations", [])
        assert all(t in tolerations for t in GPU_TOLERATIONS), (group["groupName"], tolerations)


@pytest.mark.parametrize("group", _ray_groups(RAY_MANIFEST), ids=lambda g: g.get("groupName", "head"))
def test_ray_pods_write_the_shared_volume_as_the_images_group(group):
    # Ray Train's controller (head) and workers write checkpoints on tessera-state as the `ray` user.
    assert group["template"]["spec"]["securityContext"]["fsGroup"] == IMAGE_GID


def test_every_ray_pod_mounts_the_shared_state_where_ray_storage_lives():
    ray_storage = CONFIG_MAP["data"]["TESSERA_RAY_STORAGE"]
    for group in _ray_groups(RAY_MANIFEST):
        pod = group["template"]["spec"]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        for container in pod["containers"]:
            mounts = [m for m in container["volumeMounts"] if claims.get(m["name"]) == STATE_PVC["metadata"]["name"]]
            assert mounts, f"{container['name']} does not mount {STATE_PVC['metadata']['name']}"
            assert any(Path(ray_storage).is_relative_to(m["mountPath"]) for m in mounts)
            assert {"configMapRef": {"name": "tessera-config"}} in container["envFrom"]
    assert "ReadWriteMany" in STATE_PVC["spec"]["accessModes"]
    assert Path(ray_storage).is_relative_to(CONFIG_MAP["data"]["TESSERA_HOME"])
    # A hub base model is loaded by its snapshot path in every pod: the Hugging Face cache is shared too.
    assert Path(CONFIG_MAP["data"]["HF_HOME"]).is_relative_to(CONFIG_MAP["data"]["TESSERA_HOME"])


# --- RBAC: what dagster-ray's KubeRay client calls, the step pods' service account may do --------------

_KUBERAY_CLIENT_MODULES = ("dagster_ray.kuberay.client.base", "dagster_ray.kuberay.client.raycluster.client")
_API_VERBS = {"read": "get", "get": "get", "list": "list", "create": "create", "delete": "delete",
              "patch": "patch", "replace": "update"}
_CORE_V1_RESOURCES = {"pod": "pods", "pod_log": "pods/log", "endpoints": "endpoints", "service": "services"}


def _kuberay_client_permissions() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every Kubernetes API call in dagster-ray's RayCluster client:
    `self._api` is a CustomObjectsApi on RayClusters, `self._core_v1_api` a CoreV1Api."""
    needed = set()
    for module_name in _KUBERAY_CLIENT_MODULES:
        module = __import__(module_name, fromlist=["_"])
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr in ("_api", "_core_v1_api")):
                continue
            method = node.func.attr  # e.g. get_namespaced_custom_object_status, read_namespaced_pod_log
            action, _, target = method.partition("_namespaced_")
            assert action in _API_VERBS, f"{module_name}: unknown Kubernetes API call {method}"
            if node.func.value.attr == "_api":
                resource = "rayclusters/status" if target.endswith("_status") else "rayclusters"
                needed.add(("ray.io", resource, _API_VERBS[action]))
            else:
                assert target in _CORE_V1_RESOURCES, f"{module_name}: unknown CoreV1Api call {method}"
                needed.add(("", _CORE_V1_RESOURCES[target], _API_VERBS[action]))
    return needed


def _rbac(kind: str) -> dict:
    (doc,) = [d for p, d in K8S_OBJECTS if p.name == "rbac.yaml" and d["kind"] == kind]
    return doc


def test_role_grants_every_call_dagster_rays_kuberay_client_makes():
    needed = _kuberay_client_permissions()
    # find by name, create when missing, wait for status and endpoints, read head logs, delete
    assert {("ray.io", "rayclusters", "get"), ("ray.io", "rayclusters", "create"),
            ("ray.io", "rayclusters", "delete"), ("ray.io", "rayclusters/status", "get"),
            ("", "endpoints", "get")} <= needed
    granted = {(group, resource, verb) for rule in _rbac("Role")["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert needed - granted == set()


def test_role_is_bound_to_the_service_account_of_the_run_and_step_pods():
    role, binding = _rbac("Role"), _rbac("RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    account = HELM_VALUES["global"]["serviceAccountName"]
    assert HELM_VALUES["serviceAccount"]["name"] == account
    assert {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} in binding["subjects"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE


# --- kuberay_cluster_from_manifest ----------------------------------------------------------------


def test_attach_mode_keeps_the_named_cluster_alive():
    cluster = kuberay_cluster_from_manifest(RAYCLUSTER)
    assert cluster.ray_cluster.metadata["name"] == RAY_MANIFEST["metadata"]["name"]
    assert cluster.namespace == NAMESPACE
    assert cluster.lifecycle.cleanup == "never"


@pytest.mark.parametrize("ephemeral", [False, True], ids=["attach", "ephemeral"])
def test_step_start_touches_no_cluster_until_training_connects(ephemeral):
    """Resource set-up creates, waits for and connects to nothing (no Kubernetes here: any call
    would fail), and tearing it down deletes nothing it did not create."""
    cluster = kuberay_cluster_from_manifest(RAYCLUSTER, ephemeral=ephemeral)
    lifecycle = cluster.lifecycle
    assert (lifecycle.create, lifecycle.wait, lifecycle.connect) == (False, False, False)
    with dg.build_resources({"ray_cluster": cluster}) as resources:
        ready = resources.ray_cluster
        assert (ready.created, ready.ready, ready.connected) == (False, False, False)


def test_ephemeral_mode_lets_dagster_ray_name_and_delete_the_cluster():
    cluster = kuberay_cluster_from_manifest(RAYCLUSTER, ephemeral=True, image="registry/tessera:abc123", timeout=900)
    assert "name" not in cluster.ray_cluster.metadata
    assert cluster.lifecycle.cleanup == "always"
    assert cluster.timeout == 900
    images = {c["image"] for g in (cluster.ray_cluster.spec.head_group_spec, *cluster.ray_cluster.spec.worker_group_specs)
              for c in g["template"]["spec"]["containers"]}
    assert images == {"registry/tessera:abc123"}
    assert RAY_MANIFEST["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == "tessera:latest"


@pytest.mark.parametrize("ephemeral", [False, True], ids=["code location (attach)", "ephemeral"])
def test_a_raycluster_dagster_creates_runs_the_image_of_the_run(ephemeral, monkeypatch):
    """The body dagster-ray's `KubeRayCluster.create` sends (for a missing tessera-ray, or one
    cluster per step) names the run's image, which the K8sRunLauncher records as `dagster/image`,
    not the manifest's `tessera:latest`."""
    for name in ("TESSERA_RAY_STORAGE", "MLFLOW_TRACKING_URI"):
        monkeypatch.setenv(name, CONFIG_MAP["data"][name])
    from pipelines import resources_kubernetes

    cluster = (resources_kubernetes.kuberay_cluster_on_the_run_image(RAYCLUSTER, ephemeral=True) if ephemeral
               else resources_kubernetes.kubernetes_resources()["ray_cluster"])
    run_image = "registry/tessera:0123abcd"
    context = types.SimpleNamespace(log=logging.getLogger(__name__),
                                    dagster_run=types.SimpleNamespace(tags={"dagster/image": run_image}))
    body = cluster.ray_cluster.to_k8s(context, image=cluster.get_image(context), labels={}, annotations={}, env_vars={})
    assert {c["image"] for g in _ray_groups(body) for c in g["template"]["spec"]["containers"]} == {run_image}
    assert body["metadata"].get("name") == (None if ephemeral else RAY_MANIFEST["metadata"]["name"])
    assert cluster.lifecycle.cleanup == ("always" if ephemeral else "never")


def test_production_style_definitions_load_with_kuberay_and_the_k8s_executor():
    @dg.asset(name=TRAINING_ASSET)
    def training(ray_cluster: RayResource):
        return None

    cluster = kuberay_cluster_from_manifest(RAYCLUSTER)
    assert isinstance(cluster, RayResource)  # what lora_adapter asks for
    defs = dg.Definitions(
        assets=[training], resources={"ray_cluster": cluster}, executor=tessera_k8s_executor(training_on_kuberay=True)
    )
    dg.Definitions.validate_loadable(defs)
    assert defs.resolve_implicit_global_asset_job_def().executor_def.name == EXECUTOR_NAME


def test_manifest_of_another_api_version_is_refused(tmp_path):
    manifest = copy.deepcopy(RAY_MANIFEST)
    manifest["apiVersion"] = "ray.io/v1alpha1"
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(manifest))
    with pytest.raises(KubeRayManifestError, match="v1alpha1"):
        kuberay_cluster_from_manifest(path)


def _broken(tmp_path, change) -> str:
    manifest = copy.deepcopy(RAY_MANIFEST)
    change(manifest["spec"])
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return str(path)


@pytest.mark.parametrize(("change", "message"), [
    (lambda spec: spec.pop("headGroupSpec"), r"spec\.headGroupSpec is missing"),
    (lambda spec: spec["workerGroupSpecs"][0].pop("template"), r"spec\.workerGroupSpecs\[0\]\.template\.spec\.containers must list"),
    (lambda spec: spec.update(workerGroupSpecs={"gpu": spec["workerGroupSpecs"][0]}), r"spec\.workerGroupSpecs must be a list"),
    (lambda spec: spec.update(workerGroupSpec=spec.pop("workerGroupSpecs")), r"spec\.workerGroupSpec is not a RayCluster field; did you mean spec\.workerGroupSpecs\?"),
    (lambda spec: spec["headGroupSpec"].update(rayStartParams="--num-cpus=0"), r"spec\.headGroupSpec\.rayStartParams must be a mapping"),
], ids=["no head group", "worker group without template", "worker groups as a mapping", "misspelt worker groups",
        "ray start params as a string"])
def test_a_raycluster_manifest_with_broken_groups_is_refused_by_path(tmp_path, change, message):
    path = _broken(tmp_path, change)
    with pytest.raises(KubeRayManifestError, match=message):
        kuberay_cluster_from_manifest(path, image="registry/tessera:1")


def test_unknown_kuberay_resource_options_are_refused():
    with pytest.raises(KubeRayManifestError, match=r"unknown KubeRay resource option\(s\) \['namespce'\]"):
        kuberay_cluster_from_manifest(RAYCLUSTER, namespce="x")
