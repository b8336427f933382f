"""Shared loaders, constants and helpers for the offline checks of deploy/ (not a test module).

Parses every YAML file of deploy/ once, and offers the strict Kubernetes deserializer, the RayCluster
group walker and the render of the Helm values' K8sRunLauncher block used by the test modules
`test_deploy_kubernetes_objects`, `test_deploy_helm_values` and `test_deploy_step_pods`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes.client
import yaml
from dagster_k8s.models import k8s_model_from_dict, k8s_snake_case_dict

from resources.kuberay_cluster import load_raycluster_manifest

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


# --- Helm values: the chart's K8sRunLauncher block as dagster.yaml receives it ------------------
# Field names below are those of the dagster chart's values schema (helm/dagster/schema in the
# dagster repository); the chart ships no schema inside the installed Python packages.

CHART_RUN_K8S_CONFIG = {
    "containerConfig": "container_config", "podSpecConfig": "pod_spec_config",
    "podTemplateSpecMetadata": "pod_template_spec_metadata", "jobSpecConfig": "job_spec_config",
    "jobMetadata": "job_metadata",
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
