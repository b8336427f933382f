"""Offline checks of the Helm values in deploy/dagster/values.yaml: no cluster, no Helm, no Docker.

The values use only keys of the dagster chart; the K8sRunLauncher block is rendered the way the chart
renders it and validated against the installed dagster-k8s config schema; no file of deploy/ holds a
secret value inline.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
from dagster._config import process_config
from dagster_k8s import K8sRunLauncher
from dagster_k8s.models import k8s_snake_case_dict

from tests.unit.deploy_support import (
    CHART_RUN_K8S_CONFIG,
    CONFIG_MAP,
    DEPLOY,
    HELM_VALUES,
    RAY_MANIFEST,
    STATE_PVC,
    YAML_FILES,
    _documents,
    _ray_groups,
    _render_k8s_run_launcher,
    _snake_case,
    _strict_k8s,
    _walk,
)


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
CHART_DAEMON_RUN_COORDINATOR = {"enabled", "type", "config"}
CHART_QUEUED_RUN_COORDINATOR = {
    "maxConcurrentRuns", "tagConcurrencyLimits", "dequeueIntervalSeconds", "dequeueNumWorkers", "dequeueUseThreads",
}



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
    assert set(HELM_VALUES["pythonLogs"]) <= {"pythonLogLevel", "managedPythonLoggers", "dagsterHandlerConfig"}


def test_the_cluster_instance_logs_training_cores_lines_as_the_local_one_does():
    import yaml

    from pipelines.instance import INSTANCE_SETTINGS

    local = yaml.safe_load(INSTANCE_SETTINGS)["python_logs"]
    assert HELM_VALUES["pythonLogs"] == {"managedPythonLoggers": local["managed_python_loggers"],
                                         "pythonLogLevel": local["python_log_level"]}


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
    assert type(defs.resources["ray_cluster"]).__name__ == "TrainingKubeRayCluster"


def test_code_location_pod_reads_the_schedules_run_config_from_a_mounted_config_map():
    from pipelines.jobs import RUN_CONFIG_ENV

    (deployment,) = HELM_VALUES["dagster-user-deployments"]["deployments"]
    env = {entry["name"]: entry for entry in deployment["env"]}
    for entry in deployment["env"]:
        _strict_k8s("V1EnvVar", entry)
    for volume in deployment["volumes"]:
        _strict_k8s("V1Volume", volume)
    for mount in deployment["volumeMounts"]:
        _strict_k8s("V1VolumeMount", mount)
    run_config = Path(env[RUN_CONFIG_ENV]["value"])
    config_maps = {v["name"]: v["configMap"] for v in deployment["volumes"] if "configMap" in v}
    (mount,) = [m for m in deployment["volumeMounts"] if m["name"] in config_maps]
    assert run_config.parent == Path(mount["mountPath"])  # the file is a key of the mounted ConfigMap
    assert config_maps[mount["name"]]["name"] == "tessera-run-config"
    assert config_maps[mount["name"]]["optional"] is True  # the location starts before the ConfigMap exists


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
