"""Resource wiring on Kubernetes: KubeRay for training, shared volume and MLflow server from env."""

import dagster as dg

from resources import MlflowTracker, RowGroupCache, TesseraStorage
from resources.io_manager import AtomicFilesystemIOManager
from resources.kuberay_cluster import kuberay_cluster_from_manifest


def kubernetes_resources() -> dict:
    storage = TesseraStorage(ray_storage_uri=dg.EnvVar("TESSERA_RAY_STORAGE"))
    return {
        "storage": storage,
        "io_manager": AtomicFilesystemIOManager(),  # values between steps, written atomically
        "ray_cluster": kuberay_cluster_from_manifest(),
        "mlflow_tracker": MlflowTracker(storage=storage, tracking_uri=dg.EnvVar("MLFLOW_TRACKING_URI")),
        "cache": RowGroupCache(storage=storage),
    }
