"""The Kubernetes code location (deploy/dagster/values.yaml): KubeRay for training, one pod per step."""

import dagster as dg

from deploy.k8s_executor import tessera_k8s_executor
from pipelines.graph import ASSETS, JOBS
from pipelines.jobs import daily_retrain
from pipelines.resources_kubernetes import kubernetes_resources

defs = dg.Definitions(
    assets=ASSETS,
    jobs=JOBS,
    # TESSERA_RUN_CONFIG is required: a production cluster never retrains on the demo's data.
    schedules=[daily_retrain(embedded_defaults_allowed=False)],
    resources=kubernetes_resources(),
    executor=tessera_k8s_executor(training_on_kuberay=True),
)
