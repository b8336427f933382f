"""`k8s_job_executor` for Tessera: each step runs in its own Kubernetes Job/pod.

Every step gets the small CPU pod of `STEP_RESOURCES["default"]`; the steps that need more
(`evaluation`, and `lora_adapter`, the only one that may ask for a GPU) are overridden through
`per_step_k8s_config`, keyed by op name (= asset name). Image, env (ConfigMap / Secret),
volumes and service account are inherited from the K8sRunLauncher set in deploy/dagster/values.yaml.
"""

from __future__ import annotations

from typing import Any

import dagster as dg
from dagster_k8s import k8s_job_executor

from deploy.k8s_tags import ASSET_KEYS, STEP_RESOURCES, step_k8s_config

EXECUTOR_NAME = "tessera_k8s"


def k8s_executor_config(*, training_on_kuberay: bool = False, max_concurrent: int = 4) -> dict[str, Any]:
    """Run config of `k8s_job_executor` (the `execution: config:` block), as plain data."""
    if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int) or max_concurrent < 1:
        raise ValueError(f"max_concurrent (step pods of one run at once) must be a whole number ≥ 1, got {max_concurrent!r}")
    default = STEP_RESOURCES["default"]
    per_step = {
        name: step_k8s_config(name, training_on_kuberay=training_on_kuberay)
        for name in ASSET_KEYS
        if step_k8s_config(name, training_on_kuberay=training_on_kuberay)["container_config"]["resources"] != default
    }
    return {
        # Pods of one run running at once; the training step is further limited by its `training` pool.
        "max_concurrent": max_concurrent,
        "step_k8s_config": {"container_config": {"resources": default}},
        "per_step_k8s_config": per_step,
    }


def tessera_k8s_executor(*, training_on_kuberay: bool = False, max_concurrent: int = 4) -> dg.ExecutorDefinition:
    """The executor for production `Definitions(executor=...)`.

    `training_on_kuberay=True` when `ray_cluster` is a KubeRay cluster: the training step pod is
    then only the Ray driver and asks for no GPU (the RayCluster's GPU workers do the work)."""
    config = k8s_executor_config(training_on_kuberay=training_on_kuberay, max_concurrent=max_concurrent)
    return k8s_job_executor.configured(config, name=EXECUTOR_NAME)
