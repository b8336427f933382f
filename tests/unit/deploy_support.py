"""Shared loaders, constants and helpers for the offline checks of deploy/ (not a test module).

Parses every YAML file of deploy/ once, and offers the strict Kubernetes deserializer, the RayCluster
group walker and the render of the Helm values' K8sRunLauncher block used by the test modules
`test_deploy_kubernetes_objects`, `test_deploy_helm_values` and `test_deploy_step_pods`.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes.client
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from dagster_k8s.models import k8s_model_from_dict, k8s_snake_case_dict

from resources.kuberay_cluster import load_raycluster_manifest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
VALUES = DEPLOY / "dagster" / "values.yaml"
RAYCLUSTER = DEPLOY / "kuberay" / "raycluster.yaml"
NAMESPACE = "tessera"
# The base image's `ray` user: uid 1000, primary group `users` (gid 100). Pods that write the shared
# volume run with this fsGroup.
IMAGE_UID, IMAGE_GID = 1000, 100


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


# --- the image: which of pyproject's requirements deploy/Dockerfile installs ------------------------

INSTALLS_THE_PROJECT = re.compile(r'^RUN pip install [^\n]*"\.\[([^\]]*)\]"', re.MULTILINE)


def image_extras(dockerfile: str) -> set[str]:
    """The project extras of the Dockerfile's `pip install ".[a,b]"`."""
    (extras,) = INSTALLS_THE_PROJECT.findall(dockerfile)
    return {extra.strip() for extra in extras.split(",") if extra.strip()}


def image_requirements(dockerfile: str, pyproject: str) -> dict[str, Requirement]:
    """Canonical distribution name -> requirement, for everything the image installs from pyproject."""
    project = tomllib.loads(pyproject)["project"]
    optional = project.get("optional-dependencies", {})
    extras = image_extras(dockerfile)
    if unknown := extras - set(optional):
        raise ValueError(f"deploy/Dockerfile installs extras pyproject.toml does not define: {sorted(unknown)}")
    specs = [*project["dependencies"], *(spec for extra in sorted(extras) for spec in optional[extra])]
    return {canonicalize_name(Requirement(spec).name): Requirement(spec) for spec in specs}


# --- the instance: classes the chart's dagster.yaml names ------------------------------------------
# As helm/dagster/templates/configmap-instance.yaml and helpers/instance/*.tpl of the chart write them
# for the types our values choose; a type missing here fails the test that uses it.

CHART_INSTANCE_CLASSES = {
    ("scheduler", "DagsterDaemonScheduler"): ("dagster._core.scheduler", "DagsterDaemonScheduler"),
    ("runLauncher", "K8sRunLauncher"): ("dagster_k8s", "K8sRunLauncher"),
    ("runLauncher", "CeleryK8sRunLauncher"): ("dagster_celery_k8s", "CeleryK8sRunLauncher"),
    ("runCoordinator", "QueuedRunCoordinator"): ("dagster._core.run_coordinator", "QueuedRunCoordinator"),
    ("computeLogManager", "NoOpComputeLogManager"): ("dagster._core.storage.noop_compute_log_manager", "NoOpComputeLogManager"),
    ("computeLogManager", "S3ComputeLogManager"): ("dagster_aws.s3.compute_log_manager", "S3ComputeLogManager"),
    ("computeLogManager", "GCSComputeLogManager"): ("dagster_gcp.gcs.compute_log_manager", "GCSComputeLogManager"),
    ("computeLogManager", "AzureBlobComputeLogManager"): ("dagster_azure.blob.compute_log_manager", "AzureBlobComputeLogManager"),
}
# The chart's storage is always PostgreSQL (its own subchart or an external server).
CHART_STORAGE_CLASSES = {
    "run_storage": ("dagster_postgres.run_storage", "PostgresRunStorage"),
    "event_log_storage": ("dagster_postgres.event_log", "PostgresEventLogStorage"),
    "schedule_storage": ("dagster_postgres.schedule_storage", "PostgresScheduleStorage"),
}


def rendered_instance_classes(values: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """dagster.yaml setting -> (module, class) that every Dagster process of the chart imports."""
    daemon = values.get("dagsterDaemon", {})
    coordinator = daemon.get("runCoordinator", {})
    chosen = {  # the chart's defaults where our values leave a type out
        "scheduler": ("scheduler", values.get("scheduler", {}).get("type", "DagsterDaemonScheduler")),
        "run_launcher": ("runLauncher", values["runLauncher"]["type"]),
        "compute_logs": ("computeLogManager", values.get("computeLogManager", {}).get("type", "NoOpComputeLogManager")),
    }
    if daemon.get("enabled", True) and coordinator.get("enabled"):
        chosen["run_coordinator"] = ("runCoordinator", coordinator["type"])
    return {**CHART_STORAGE_CLASSES, **{setting: CHART_INSTANCE_CLASSES[key] for setting, key in chosen.items()}}


def distribution_of(module: str) -> str:
    """The distribution that ships a Dagster module: `dagster._core.x` -> dagster, `dagster_k8s` -> dagster-k8s."""
    return canonicalize_name(module.split(".")[0])
