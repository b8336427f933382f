"""Offline checks of the Kubernetes deployment in deploy/: no cluster, no Helm, no Docker.

Kubernetes objects go through dagster-k8s's strict deserializer (unknown keys rejected at every
level, required fields enforced by the `kubernetes` client models); the RayCluster goes through
dagster-ray's own pydantic config models; the Helm values are rendered the way the dagster chart
renders its K8sRunLauncher block and validated against the installed dagster-k8s config schema;
step pods are assembled with dagster-k8s's own merge and Job construction.
"""

from __future__ import annotations

import ast
import copy
import json
import logging
import re
import sys
import types
from importlib.metadata import version
from pathlib import Path
from typing import Any

import dagster as dg
import kubernetes.client
import pytest
import yaml
from dagster._config import process_config
from dagster_k8s import K8sRunLauncher, construct_dagster_k8s_job, k8s_job_executor
from dagster_k8s.container_context import K8sContainerContext
from dagster_k8s.job import DagsterK8sJobConfig, UserDefinedDagsterK8sConfig, get_user_defined_k8s_config
from dagster_k8s.models import k8s_model_from_dict, k8s_snake_case_dict
from dagster_ray import RayResource
from kubernetes.utils import parse_quantity

from deploy.k8s_executor import EXECUTOR_NAME, k8s_executor_config, tessera_k8s_executor
from deploy.k8s_tags import (
    ASSET_KEYS,
    GPU_RESOURCE,
    K8S_CONFIG_TAG,
    KUBERAY_DRIVER_RESOURCES,
    STEP_RESOURCES,
    TRAINING_ASSET,
    op_tags_for,
    resources_for,
)
from resources.kuberay_cluster import (
    KubeRayManifestError,
    kuberay_cluster_from_manifest,
    load_raycluster_manifest,
    raycluster_config_from_manifest,
)

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
VALUES = DEPLOY / "dagster" / "values.yaml"
RAYCLUSTER = DEPLOY / "kuberay" / "raycluster.yaml"
NAMESPACE = "tessera"


def _documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


YAML_FILES = sorted(DEPLOY.rglob("*.yaml"))
K8S_OBJECTS = [
    (path, doc)
    for path in YAML_FILES
    if path != VALUES
    for doc in _documents(path)
]
HELM_VALUES = _documents(VALUES)[0]
RAY_MANIFEST = load_raycluster_manifest(RAYCLUSTER)
CONFIG_MAP = next(doc for _, doc in K8S_OBJECTS if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "tessera-config")
STATE_PVC = next(doc for _, doc in K8S_OBJECTS if doc["kind"] == "PersistentVolumeClaim")


def _strict_k8s(model_name: str, data: dict[str, Any]) -> Any:
    """A `kubernetes.client` model from a camelCase manifest dict; unknown keys at any depth raise."""
    model = getattr(kubernetes.client, model_name)
    return k8s_model_from_dict(model, k8s_snake_case_dict(model, data))


def _k8s_model_name(doc: dict[str, Any]) -> str:
    group_version = doc["apiVersion"].split("/")[-1]  # "v1", "rbac.authorization.k8s.io/v1" -> "v1"
    return f"{group_version.capitalize()}{doc['kind']}"


def _ray_groups(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return [manifest["spec"]["headGroupSpec"], *manifest["spec"]["workerGroupSpecs"]]


def _walk(node: Any, path: str = ""):
    """Every (path, key, value) of nested mappings and lists."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield path, key, value
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, f"{path}[{index}]")


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
    base_image = re.search(r"^FROM (\S+)", (DEPLOY / "Dockerfile").read_text(), re.MULTILINE).group(1)
    assert base_image == f"rayproject/ray:{ray_version}-{python_tag}-gpu"
    assert f"rayproject/ray:{ray_version}-{python_tag}-gpu" in RAYCLUSTER.read_text()


def test_head_exposes_the_ray_client_port_dagster_ray_connects_to():
    cluster = kuberay_cluster_from_manifest(RAYCLUSTER)
    (head_container,) = RAY_MANIFEST["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    ports = {port["containerPort"] for port in head_container["ports"]}
    assert {cluster.redis_port, cluster.dashboard_port, 6379} <= ports


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


# --- kuberay_cluster_from_manifest ----------------------------------------------------------------


def test_attach_mode_keeps_the_named_cluster_alive():
    cluster = kuberay_cluster_from_manifest(RAYCLUSTER)
    assert cluster.ray_cluster.metadata["name"] == RAY_MANIFEST["metadata"]["name"]
    assert cluster.namespace == NAMESPACE
    assert cluster.lifecycle.cleanup == "never"


def test_ephemeral_mode_lets_dagster_ray_name_and_delete_the_cluster():
    cluster = kuberay_cluster_from_manifest(RAYCLUSTER, ephemeral=True, image="registry/tessera:abc123", timeout=900)
    assert "name" not in cluster.ray_cluster.metadata
    assert cluster.lifecycle.cleanup == "always"
    assert cluster.timeout == 900
    images = {c["image"] for g in (cluster.ray_cluster.spec.head_group_spec, *cluster.ray_cluster.spec.worker_group_specs)
              for c in g["template"]["spec"]["containers"]}
    assert images == {"registry/tessera:abc123"}
    assert RAY_MANIFEST["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == "tessera:latest"


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


# --- Helm values ---------------------------------------------------------------------------------
# Field names below are those of the dagster chart's values schema (helm/dagster/schema in the
# dagster repository); the chart ships no schema inside the installed Python packages.

CHART_TOP_LEVEL = {
    "global", "serviceAccount", "generatePostgresqlPasswordSecret", "postgresql", "dagster-user-deployments",
    "runLauncher", "dagsterDaemon", "dagsterWebserver", "computeLogManager", "pythonLogs", "imagePullSecrets",
    "ingress", "migrate", "telemetry", "retention", "concurrency", "scheduler", "busybox", "rabbitmq", "redis",
    "flower", "generateCeleryConfigSecret", "additionalInstanceConfig",
}
CHART_GLOBAL = {"postgresqlSecretName", "dagsterHome", "serviceAccountName", "celeryConfigSecretName"}
CHART_SERVICE_ACCOUNT = {"create", "name", "annotations"}
CHART_POSTGRESQL = {
    "enabled", "image", "postgresqlHost", "postgresqlUsername", "postgresqlPassword", "postgresqlDatabase",
    "postgresqlParams", "postgresqlScheme", "service",
}
CHART_USER_DEPLOYMENTS = {"enabled", "enableSubchart", "imagePullSecrets", "deployments"}
CHART_USER_DEPLOYMENT = {
    "name", "image", "dagsterApiGrpcArgs", "codeServerArgs", "includeConfigInLaunchedRuns", "deploymentNamespace",
    "port", "replicaCount", "env", "envConfigMaps", "envSecrets", "annotations", "nodeSelector", "affinity",
    "tolerations", "podSecurityContext", "securityContext", "resources", "livenessProbe", "readinessProbe",
    "startupProbe", "labels", "volumeMounts", "volumes", "schedulerName", "initContainers", "sidecarContainers",
    "deploymentStrategy",
}
CHART_RUN_K8S_CONFIG = {
    "containerConfig": "container_config", "podSpecConfig": "pod_spec_config",
    "podTemplateSpecMetadata": "pod_template_spec_metadata", "jobSpecConfig": "job_spec_config",
    "jobMetadata": "job_metadata",
}
CHART_DAEMON_RUN_COORDINATOR = {"enabled", "type", "config"}
CHART_QUEUED_RUN_COORDINATOR = {
    "maxConcurrentRuns", "tagConcurrencyLimits", "dequeueIntervalSeconds", "dequeueNumWorkers", "dequeueUseThreads",
}


def _snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _render_k8s_run_launcher(values: dict[str, Any]) -> dict[str, Any]:
    """The `run_launcher.config` of dagster.yaml, as the chart's `dagsterYaml.runLauncher.k8s`
    template writes it from the values (names of env sources, snake_case run_k8s_config keys)."""
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    rendered: dict[str, Any] = {
        "load_incluster_config": launcher["loadInclusterConfig"],
        "job_namespace": launcher.get("jobNamespace") or NAMESPACE,
        "image_pull_policy": launcher["imagePullPolicy"],
        "service_account_name": values["global"]["serviceAccountName"],
        "dagster_home": "/opt/dagster/dagster_home",
        "instance_config_map": "dagster-instance",
        "postgres_password_secret": values["global"]["postgresqlSecretName"],
    }
    if launcher.get("envConfigMaps"):
        rendered["env_config_maps"] = [source["name"] for source in launcher["envConfigMaps"]]
    if launcher.get("envSecrets"):
        rendered["env_secrets"] = [source["name"] for source in launcher["envSecrets"]]
    for key in ("envVars", "volumeMounts", "volumes", "labels", "resources", "schedulerName", "securityContext"):
        if launcher.get(key):
            rendered[_snake_case(key)] = launcher[key]
    if launcher.get("runK8sConfig"):
        rendered["run_k8s_config"] = {CHART_RUN_K8S_CONFIG[k]: v for k, v in launcher["runK8sConfig"].items()}
    return rendered


def test_helm_values_use_only_keys_the_dagster_chart_defines():
    assert set(HELM_VALUES) <= CHART_TOP_LEVEL
    assert set(HELM_VALUES["global"]) <= CHART_GLOBAL
    assert set(HELM_VALUES["serviceAccount"]) <= CHART_SERVICE_ACCOUNT
    assert set(HELM_VALUES["postgresql"]) <= CHART_POSTGRESQL
    user_code = HELM_VALUES["dagster-user-deployments"]
    assert set(user_code) <= CHART_USER_DEPLOYMENTS
    for deployment in user_code["deployments"]:
        assert set(deployment) <= CHART_USER_DEPLOYMENT
    assert set(HELM_VALUES["runLauncher"]["config"]["k8sRunLauncher"].get("runK8sConfig", {})) <= set(CHART_RUN_K8S_CONFIG)
    coordinator = HELM_VALUES["dagsterDaemon"]["runCoordinator"]
    assert set(coordinator) <= CHART_DAEMON_RUN_COORDINATOR
    assert set(coordinator["config"]["queuedRunCoordinator"]) <= CHART_QUEUED_RUN_COORDINATOR


def test_k8s_run_launcher_values_are_fields_of_the_installed_k8s_run_launcher():
    launcher = HELM_VALUES["runLauncher"]["config"]["k8sRunLauncher"]
    assert HELM_VALUES["runLauncher"]["type"] == "K8sRunLauncher"
    fields = set(K8sRunLauncher.config_type().keys())
    unknown = {key for key in launcher if _snake_case(key) not in fields}
    assert not unknown, f"not K8sRunLauncher config fields: {unknown}"


def test_rendered_run_launcher_config_passes_the_dagster_k8s_schema():
    result = process_config(K8sRunLauncher.config_type(), _render_k8s_run_launcher(HELM_VALUES))
    assert result.success, [error.message for error in result.errors]


def test_run_launcher_config_schema_check_can_fail():
    rendered = _render_k8s_run_launcher(HELM_VALUES)
    rendered["env_secret"] = ["tessera-secrets"]
    assert not process_config(K8sRunLauncher.config_type(), rendered).success


def test_helm_kubernetes_fragments_are_valid_kubernetes_fields():
    launcher = HELM_VALUES["runLauncher"]["config"]["k8sRunLauncher"]
    for volume in launcher["volumes"]:
        _strict_k8s("V1Volume", volume)
    for mount in launcher["volumeMounts"]:
        _strict_k8s("V1VolumeMount", mount)
    run_k8s = launcher["runK8sConfig"]
    k8s_snake_case_dict(kubernetes.client.V1Container, run_k8s["containerConfig"])  # partial container: keys only
    k8s_snake_case_dict(kubernetes.client.V1PodSpec, run_k8s["podSpecConfig"])
    _strict_k8s("V1ResourceRequirements", run_k8s["containerConfig"]["resources"])
    for deployment in HELM_VALUES["dagster-user-deployments"]["deployments"]:
        _strict_k8s("V1ResourceRequirements", deployment["resources"])
        for source in deployment["envSecrets"]:
            _strict_k8s("V1SecretEnvSource", source)
        for source in deployment["envConfigMaps"]:
            _strict_k8s("V1ConfigMapEnvSource", source)
    for source in launcher["envSecrets"]:
        _strict_k8s("V1SecretEnvSource", source)


def test_code_location_serves_the_kubernetes_definitions(monkeypatch):
    (deployment,) = HELM_VALUES["dagster-user-deployments"]["deployments"]
    assert deployment["image"]["repository"] == "tessera" and deployment["image"]["tag"] == "latest"
    assert deployment["dagsterApiGrpcArgs"] == ["-m", "pipelines.definitions_kubernetes"]
    assert deployment["includeConfigInLaunchedRuns"]["enabled"] is True
    monkeypatch.setenv("TESSERA_RAY_STORAGE", "/var/lib/tessera/ray")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    import importlib

    module = importlib.import_module("pipelines.definitions_kubernetes")
    defs = module.defs
    assert {key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys()} >= {
        "raw_examples", "training_dataset", "row_group_cache", "base_model", "lora_adapter", "evaluation",
        "promoted_model"}
    assert type(defs.resources["ray_cluster"]).__name__ == "KubeRayCluster"


def test_instance_uses_postgres_with_the_password_from_a_secret():
    assert HELM_VALUES["generatePostgresqlPasswordSecret"] is False
    assert HELM_VALUES["global"]["postgresqlSecretName"]
    assert "postgresqlPassword" not in HELM_VALUES["postgresql"]
    assert HELM_VALUES["postgresql"]["postgresqlHost"]


def test_run_pods_mount_the_same_shared_state_as_the_ray_pods():
    launcher = HELM_VALUES["runLauncher"]["config"]["k8sRunLauncher"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in launcher["volumes"]}
    mounts = [m for m in launcher["volumeMounts"] if claims.get(m["name"]) == STATE_PVC["metadata"]["name"]]
    ray_mounts = {m["mountPath"] for g in _ray_groups(RAY_MANIFEST) for c in g["template"]["spec"]["containers"]
                  for m in c["volumeMounts"] if m["name"] == "tessera-state"}
    assert [m["mountPath"] for m in mounts] == sorted(ray_mounts)
    assert Path(CONFIG_MAP["data"]["TESSERA_RAY_STORAGE"]).is_relative_to(mounts[0]["mountPath"])


# --- no secret values anywhere ------------------------------------------------------------------

SECRET_WORDS = {"password", "passwd", "token", "secret", "credential", "credentials", "apikey"}
URL_WITH_CREDENTIALS = re.compile(r"://[^/\s:@]+:[^/\s@]+@")


def _looks_secret(name: str) -> bool:
    """`MLFLOW_TRACKING_PASSWORD`, `postgresqlPassword`, `AWS_SECRET_ACCESS_KEY`, `apiKey`: yes;
    `TOKENIZERS_PARALLELISM`, `postgresqlSecretName` (a reference): no."""
    words = [w.lower() for w in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", name)]
    if words and words[-1] == "name":
        return False
    joined = {a + b for a, b in zip(words, words[1:])}
    return bool(SECRET_WORDS & (set(words) | joined) or {"accesskey"} & joined)


def _inline_secrets(document: Any) -> list[str]:
    found = []
    for path, key, value in _walk(document):
        if isinstance(value, str) and URL_WITH_CREDENTIALS.search(value):
            found.append(f"{path}.{key}: URL with credentials")
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and _looks_secret(str(key)):
            found.append(f"{path}.{key}")
        if key in ("env", "envVars") and isinstance(value, list):
            for entry in value:
                name = entry.get("name", "") if isinstance(entry, dict) else str(entry).split("=")[0]
                if _looks_secret(name) and not (isinstance(entry, dict) and "secretKeyRef" in entry.get("valueFrom", {})):
                    found.append(f"{path}.{key}: {name} must come from a secretKeyRef / envFrom Secret")
    return found


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_no_secret_values_inline(path):
    for document in _documents(path):
        assert document.get("kind") != "Secret", f"{path}: Secrets are created with kubectl, not committed"
        if document.get("kind") == "ConfigMap":
            assert not [key for key in document["data"] if _looks_secret(key)], f"{path}: secret in a ConfigMap"
        assert _inline_secrets(document) == []


def test_secret_scan_catches_inline_values():
    leaky = {
        "postgresql": {"postgresqlPassword": "hunter2"},
        "env": [{"name": "MLFLOW_TRACKING_PASSWORD", "value": "hunter2"}],
        "uri": "http://user:hunter2@mlflow:5000",
    }
    assert len(_inline_secrets(leaky)) == 3
    assert _inline_secrets({"env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}) == []
    secret_like = ("AWS_SECRET_ACCESS_KEY", "apiKey", "MLFLOW_TRACKING_TOKEN", "generatePostgresqlPasswordSecret")
    assert all(_looks_secret(name) for name in secret_like)
    assert not any(_looks_secret(name) for name in ("TOKENIZERS_PARALLELISM", "postgresqlSecretName", "envSecrets"))


def test_credentials_reach_pods_only_through_secret_references():
    launcher = HELM_VALUES["runLauncher"]["config"]["k8sRunLauncher"]
    assert {"name": "tessera-secrets"} in launcher["envSecrets"]
    assert not [entry for entry in launcher["envVars"] if _looks_secret(entry.split("=")[0])]
    assert not URL_WITH_CREDENTIALS.search(CONFIG_MAP["data"]["MLFLOW_TRACKING_URI"])


# --- per-step pods: only the training step asks for a GPU ------------------------------------------


def _asset_functions() -> set[str]:
    names = set()
    for path in (REPO / "assets").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for decorator in node.decorator_list:
                    target = decorator.func if isinstance(decorator, ast.Call) else decorator
                    if isinstance(target, ast.Attribute) and target.attr == "asset" or (
                        isinstance(target, ast.Name) and target.id == "asset"
                    ):
                        names.add(node.name)
    return names


def test_pod_resources_cover_exactly_the_assets_of_the_code_location():
    assert set(ASSET_KEYS) == _asset_functions()
    with pytest.raises(ValueError, match="unknown asset"):
        op_tags_for("lora_adaptor")


@pytest.mark.parametrize("training_on_kuberay", [False, True])
def test_only_lora_adapter_requests_gpus(training_on_kuberay):
    wanting_gpu = {
        name for name in ASSET_KEYS
        if GPU_RESOURCE in {**(r := resources_for(name, training_on_kuberay=training_on_kuberay))["requests"], **r["limits"]}
    }
    assert wanting_gpu == (set() if training_on_kuberay else {TRAINING_ASSET})


def _all_resource_blocks():
    """Every container `resources` block Tessera defines, with a label."""
    yield "STEP_RESOURCES", STEP_RESOURCES.values()
    yield "KUBERAY_DRIVER_RESOURCES", [KUBERAY_DRIVER_RESOURCES]
    yield "raycluster", [c["resources"] for g in _ray_groups(RAY_MANIFEST) for c in g["template"]["spec"]["containers"]]
    launcher = HELM_VALUES["runLauncher"]["config"]["k8sRunLauncher"]
    yield "values", [launcher["runK8sConfig"]["containerConfig"]["resources"],
                     *(d["resources"] for d in HELM_VALUES["dagster-user-deployments"]["deployments"])]


def test_resource_quantities_parse_and_requests_fit_in_limits():
    for label, blocks in _all_resource_blocks():
        for resources in blocks:
            _strict_k8s("V1ResourceRequirements", resources)
            for name, request in resources["requests"].items():
                assert name in resources["limits"], f"{label}: {name} is requested without a limit"
                limit = resources["limits"][name]
                assert parse_quantity(request) <= parse_quantity(limit), f"{label}: {name} request > limit"
            if GPU_RESOURCE in resources["limits"]:
                # Extended resources cannot be overcommitted: Kubernetes requires request == limit.
                gpus = parse_quantity(resources["limits"][GPU_RESOURCE])
                assert gpus == int(gpus) >= 1
                gpu_limit = resources["limits"][GPU_RESOURCE]
                assert resources["requests"].get(GPU_RESOURCE, gpu_limit) == gpu_limit, f"{label}: GPU request != limit"


def test_op_tags_are_read_back_by_dagster_k8s():
    @dg.asset(name=TRAINING_ASSET, op_tags=op_tags_for(TRAINING_ASSET))
    def training():
        return None

    tags = training.op.tags
    assert json.loads(tags[K8S_CONFIG_TAG])["container_config"]["resources"] == STEP_RESOURCES[TRAINING_ASSET]
    parsed = get_user_defined_k8s_config(tags)
    assert parsed.container_config["resources"]["limits"][GPU_RESOURCE] == "1"
    assert {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in parsed.pod_spec_config["tolerations"]


@pytest.mark.parametrize("training_on_kuberay", [False, True])
def test_executor_config_passes_the_k8s_job_executor_schema(training_on_kuberay):
    config = k8s_executor_config(training_on_kuberay=training_on_kuberay)
    result = process_config(k8s_job_executor.config_schema.config_type, config)
    assert result.success, [error.message for error in result.errors]
    assert set(config["per_step_k8s_config"]) <= set(ASSET_KEYS)
    assert tessera_k8s_executor(training_on_kuberay=training_on_kuberay).name == EXECUTOR_NAME
    broken = {**config, "step_k8s_config": {"containr_config": {}}}
    assert not process_config(k8s_job_executor.config_schema.config_type, broken).success


def _layer(config: UserDefinedDagsterK8sConfig) -> K8sContainerContext:
    return K8sContainerContext(run_k8s_config=config)


def _step_job(asset_name: str, *, training_on_kuberay: bool, with_op_tags: bool) -> kubernetes.client.V1Job:
    """The Job the k8s_job_executor would create for one step, assembled the way
    `K8sStepHandler._get_container_context` merges its layers: run launcher (from the Helm
    values), executor config, the op's `dagster-k8s/config` tag, then `per_step_k8s_config`."""
    launcher = process_config(K8sRunLauncher.config_type(), _render_k8s_run_launcher(HELM_VALUES)).value
    context = K8sContainerContext(
        image_pull_policy=launcher["image_pull_policy"],
        service_account_name=launcher["service_account_name"],
        env_config_maps=launcher.get("env_config_maps"),
        env_secrets=launcher.get("env_secrets"),
        env_vars=launcher.get("env_vars"),
        volume_mounts=launcher.get("volume_mounts"),
        volumes=launcher.get("volumes"),
        namespace=launcher["job_namespace"],
        run_k8s_config=UserDefinedDagsterK8sConfig.from_dict(launcher.get("run_k8s_config") or {}),
    )
    executor = process_config(
        k8s_job_executor.config_schema.config_type, k8s_executor_config(training_on_kuberay=training_on_kuberay)
    ).value
    context = context.merge(_layer(UserDefinedDagsterK8sConfig.from_dict(executor["step_k8s_config"])))
    if with_op_tags:
        tag = op_tags_for(asset_name, training_on_kuberay=training_on_kuberay)[K8S_CONFIG_TAG]
        context = context.merge(_layer(get_user_defined_k8s_config({K8S_CONFIG_TAG: json.dumps(tag)})))
    per_step = executor["per_step_k8s_config"].get(asset_name, {})
    context = context.merge(_layer(UserDefinedDagsterK8sConfig.from_dict(per_step)))
    job_config = DagsterK8sJobConfig(
        job_image="tessera:latest",
        dagster_home=launcher["dagster_home"],
        instance_config_map=launcher["instance_config_map"],
        postgres_password_secret=launcher["postgres_password_secret"],
    )
    job = construct_dagster_k8s_job(
        job_config, ["dagster", "api", "execute_step"], f"dagster-step-{asset_name.replace('_', '-')}",
        user_defined_k8s_config=context.run_k8s_config, component="step_worker",
    )
    # The Job must survive a round trip through the strict deserializer, like any manifest.
    _strict_k8s("V1Job", kubernetes.client.ApiClient().sanitize_for_serialization(job))
    return job


@pytest.mark.parametrize("with_op_tags", [False, True], ids=["executor-only", "executor+op-tags"])
@pytest.mark.parametrize("training_on_kuberay", [False, True], ids=["ray-in-pod", "kuberay"])
def test_step_pods_as_dagster_k8s_builds_them(training_on_kuberay, with_op_tags):
    gpu_steps = set()
    for asset_name in ASSET_KEYS:
        job = _step_job(asset_name, training_on_kuberay=training_on_kuberay, with_op_tags=with_op_tags)
        pod = job.spec.template.spec
        (container,) = pod.containers
        expected = resources_for(asset_name, training_on_kuberay=training_on_kuberay)
        assert container.resources.limits == expected["limits"], asset_name
        assert container.resources.requests == expected["requests"], asset_name
        if GPU_RESOURCE in container.resources.limits:
            gpu_steps.add(asset_name)
            assert any(t.key == GPU_RESOURCE for t in pod.tolerations or [])
        # every step: settings and credentials by reference, shared state mounted
        sources = {(s.config_map_ref.name if s.config_map_ref else None, s.secret_ref.name if s.secret_ref else None)
                   for s in container.env_from}
        assert ("tessera-config", None) in sources and (None, "tessera-secrets") in sources
        assert [m.mount_path for m in container.volume_mounts if m.name == "tessera-state"] == ["/var/lib/tessera"]
        assert pod.service_account_name == HELM_VALUES["global"]["serviceAccountName"]
    assert gpu_steps == (set() if training_on_kuberay else {TRAINING_ASSET})


def test_gpus_on_kuberay_live_only_in_the_ray_worker_group():
    gpu_groups = [
        group.get("groupName", "head") for group in _ray_groups(RAY_MANIFEST)
        for container in group["template"]["spec"]["containers"]
        if GPU_RESOURCE in container.get("resources", {}).get("limits", {})
    ]
    assert gpu_groups == ["gpu"]
