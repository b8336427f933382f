"""Pod resources for each Dagster step on Kubernetes, as `dagster-k8s/config` op tags.

Pure data (no dagster import): `deploy.k8s_executor` and the manifest tests read the same mapping.
Only the training step may ask for GPUs; everything else gets a small CPU pod.

Two ways to train on Kubernetes, and they size the `lora_adapter` pod differently:
- Ray inside the step pod (`LocalRayCluster`): the step pod *is* the GPU machine -> STEP_RESOURCES.
- Ray on KubeRay (`resources.kuberay_cluster`): the step pod is only the Ray Client driver; the
  GPUs belong to the RayCluster's worker group -> KUBERAY_DRIVER_RESOURCES, no GPU in the pod.
"""

from __future__ import annotations

import copy
from typing import Any

K8S_CONFIG_TAG = "dagster-k8s/config"
GPU_RESOURCE = "nvidia.com/gpu"
TRAINING_ASSET = "lora_adapter"

# Asset keys of the code location (contract, DESIGN.md); a name outside this set is a typo.
ASSET_KEYS = (
    "raw_examples",
    "training_dataset",
    "row_group_cache",
    "base_model",
    "lora_adapter",
    "evaluation",
    "promoted_model",
)

STEP_RESOURCES: dict[str, dict[str, dict[str, str]]] = {
    # Data assets (generate / tokenize / pack one day's partition, warm the cache): one busy core,
    # memory bounded by a partition's row groups.
    "default": {
        "requests": {"cpu": "500m", "memory": "2Gi"},
        "limits": {"cpu": "2", "memory": "4Gi"},
    },
    # Evaluation loads the base and the trained model side by side on CPU.
    "evaluation": {
        "requests": {"cpu": "2", "memory": "8Gi"},
        "limits": {"cpu": "4", "memory": "16Gi"},
    },
    # Training with Ray inside the step pod. Extended resources (GPUs) cannot be overcommitted:
    # Kubernetes requires request == limit, so both say 1.
    TRAINING_ASSET: {
        "requests": {"cpu": "8", "memory": "48Gi", GPU_RESOURCE: "1"},
        "limits": {"cpu": "8", "memory": "48Gi", GPU_RESOURCE: "1"},
    },
}

# Training with Ray on KubeRay: the pod runs the Ray Client driver (submits the TorchTrainer,
# copies the final adapter out of Ray storage, logs to MLflow). No GPU here.
KUBERAY_DRIVER_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "1", "memory": "4Gi"},
    "limits": {"cpu": "2", "memory": "8Gi"},
}

# GPU nodes are usually tainted so that only pods asking for GPUs land there.
GPU_TOLERATIONS: list[dict[str, str]] = [
    {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
]


def resources_for(asset_name: str, *, training_on_kuberay: bool = False) -> dict[str, dict[str, str]]:
    """Container `resources` (requests/limits) for the step that materializes `asset_name`."""
    if asset_name not in ASSET_KEYS:
        raise ValueError(f"unknown asset {asset_name!r}: pod resources are defined for {', '.join(ASSET_KEYS)}")
    if asset_name == TRAINING_ASSET and training_on_kuberay:
        return copy.deepcopy(KUBERAY_DRIVER_RESOURCES)
    return copy.deepcopy(STEP_RESOURCES.get(asset_name, STEP_RESOURCES["default"]))


def step_k8s_config(asset_name: str, *, training_on_kuberay: bool = False) -> dict[str, Any]:
    """The `dagster-k8s/config` value (snake_case keys, as dagster-k8s expects) for one step."""
    resources = resources_for(asset_name, training_on_kuberay=training_on_kuberay)
    # SHALLOW: this step's `resources` replace the inherited ones as a whole. Under the default DEEP
    # merge, keys union across layers (run launcher, executor, op tags), so a GPU limit set in one
    # layer would survive an override that leaves it out. Lists and other keys (env, volumes) are kept.
    config: dict[str, Any] = {"container_config": {"resources": resources}, "merge_behavior": "SHALLOW"}
    if GPU_RESOURCE in resources["limits"]:
        config["pod_spec_config"] = {"tolerations": copy.deepcopy(GPU_TOLERATIONS)}
    return config


def op_tags_for(asset_name: str, *, training_on_kuberay: bool = False) -> dict[str, Any]:
    """Op tags for `@dg.asset(op_tags=...)`: `{"dagster-k8s/config": {...}}`."""
    return {K8S_CONFIG_TAG: step_k8s_config(asset_name, training_on_kuberay=training_on_kuberay)}
