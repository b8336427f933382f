"""Offline checks of the per-step pods in deploy/: no cluster, no Helm, no Docker.

Only the training step asks for a GPU; resource quantities parse; op tags and the k8s_job_executor
config are read back by dagster-k8s; step pods are assembled with dagster-k8s's own merge and Job
construction; the IO manager keeps values between steps on the volume every step pod mounts.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import dagster as dg
import kubernetes.client
import pytest
from dagster._config import process_config
from dagster_k8s import K8sRunLauncher, construct_dagster_k8s_job, k8s_job_executor
from dagster_k8s.container_context import K8sContainerContext
from dagster_k8s.job import DagsterK8sJobConfig, UserDefinedDagsterK8sConfig, get_user_defined_k8s_config
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
from tests.unit.deploy_support import (
    CONFIG_MAP,
    HELM_VALUES,
    IMAGE_GID,
    RAY_MANIFEST,
    REPO,
    STATE_PVC,
    _ray_groups,
    _render_k8s_run_launcher,
    _strict_k8s,
)


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
        # the image runs as `ray`: the volume's files are group-writable for the image's group
        assert pod.security_context.fs_group == IMAGE_GID, asset_name
        assert pod.service_account_name == HELM_VALUES["global"]["serviceAccountName"]
    assert gpu_steps == (set() if training_on_kuberay else {TRAINING_ASSET})


def test_gpus_on_kuberay_live_only_in_the_ray_worker_group():
    gpu_groups = [
        group.get("groupName", "head") for group in _ray_groups(RAY_MANIFEST)
        for container in group["template"]["spec"]["containers"]
        if GPU_RESOURCE in container.get("resources", {}).get("limits", {})
    ]
    assert gpu_groups == ["gpu"]


@pytest.mark.parametrize("value", [0, -1, "4", True])
def test_max_concurrent_step_pods_must_be_a_positive_whole_number(value):
    from deploy.k8s_executor import k8s_executor_config

    with pytest.raises(ValueError, match=f"max_concurrent \\(step pods of one run at once\\) must be a whole number ≥ 1, got {value!r}"):
        k8s_executor_config(max_concurrent=value)


# --- values between steps: on the volume every step pod mounts --------------------------------------


@pytest.fixture
def kubernetes_code_location_env(monkeypatch):
    """The env the step pods get from the ConfigMap `tessera-config`."""
    for name in ("TESSERA_HOME", "TESSERA_RAY_STORAGE", "MLFLOW_TRACKING_URI"):
        monkeypatch.setenv(name, CONFIG_MAP["data"][name])


def test_io_manager_keeps_step_values_on_the_shared_volume_not_in_dagster_home(kubernetes_code_location_env):
    from pipelines.resources_kubernetes import kubernetes_resources

    base_dir = kubernetes_resources()["io_manager"].base_dir
    # Without a base_dir the values go to $DAGSTER_HOME/storage: the pod's own disk.
    assert base_dir, "the Kubernetes IO manager has no base_dir: values would stay in each step pod's DAGSTER_HOME"
    for training_on_kuberay in (False, True):
        for asset_name in ASSET_KEYS:
            (container,) = _step_job(asset_name, training_on_kuberay=training_on_kuberay,
                                     with_op_tags=False).spec.template.spec.containers
            shared = [m.mount_path for m in container.volume_mounts if m.name == STATE_PVC["metadata"]["name"]]
            assert shared and Path(base_dir).is_relative_to(shared[0]), (asset_name, base_dir, shared)
            dagster_home = next(e.value for e in container.env if e.name == "DAGSTER_HOME")
            assert not any(Path(dagster_home).is_relative_to(m.mount_path) for m in container.volume_mounts)
            assert not Path(base_dir).is_relative_to(dagster_home)


def test_a_step_in_another_pod_reads_the_value_its_upstream_step_wrote(kubernetes_code_location_env,
                                                                      monkeypatch, tmp_path):
    """Two step pods: each its own DAGSTER_HOME, both the same TESSERA_HOME (the shared volume)."""
    from pipelines.resources_kubernetes import kubernetes_resources

    monkeypatch.setenv("TESSERA_HOME", str(tmp_path / "shared-volume"))
    io_manager = kubernetes_resources()["io_manager"]

    @dg.asset
    def upstream():
        return {"rows": 3}

    @dg.asset
    def downstream(upstream):
        return upstream["rows"] * 2

    pod_a_home, pod_b_home = tmp_path / "pod-a-dagster-home", tmp_path / "pod-b-dagster-home"
    pod_a_home.mkdir(), pod_b_home.mkdir()
    with dg.instance_for_test(temp_dir=str(pod_a_home)) as pod_a:
        assert dg.materialize([upstream], instance=pod_a, resources={"io_manager": io_manager}).success
    with dg.instance_for_test(temp_dir=str(pod_b_home)) as pod_b:
        result = dg.materialize([upstream, downstream], selection=[downstream], instance=pod_b,
                                resources={"io_manager": io_manager})
        assert result.success and result.output_for_node("downstream") == 6
    assert (tmp_path / "shared-volume" / "dagster" / "storage" / "upstream").is_file()
