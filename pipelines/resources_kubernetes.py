"""Resource wiring on Kubernetes: KubeRay for training, shared volume and MLflow server from env."""

import copy
from pathlib import Path

import dagster as dg

from resources import MlflowTracker, RowGroupCache, RunProcess, TesseraStorage
from resources.io_manager import AtomicFilesystemIOManager
from resources.kuberay_cluster import (
    DEFAULT_MANIFEST,
    TrainingKubeRayCluster,
    kuberay_cluster_from_manifest,
    load_raycluster_manifest,
    raycluster_config_from_manifest,
)

# Under the state root, as locally (where DAGSTER_HOME is <root>/dagster and Dagster's default is
# $DAGSTER_HOME/storage), so one state folder has the same layout in both code locations.
STEP_VALUES_FOLDER = Path("dagster") / "storage"


def step_values_dir(storage: TesseraStorage) -> str:
    """Where the IO manager keeps values between steps: on the shared state volume.

    Under `k8s_job_executor` each step is a pod of its own, and the Dagster chart's DAGSTER_HOME
    (/opt/dagster/dagster_home) is the pod's own disk: the default base_dir ($DAGSTER_HOME/storage)
    would leave an upstream value behind in the pod that wrote it. $TESSERA_HOME is the volume
    `tessera-state` that every run and step pod mounts (deploy/shared-state.yaml)."""
    return str(storage.root / STEP_VALUES_FOLDER)


def kuberay_cluster_on_the_run_image(
    manifest: str | Path = DEFAULT_MANIFEST, *, ephemeral: bool = False
) -> TrainingKubeRayCluster:
    """`kuberay_cluster_from_manifest`, except that a RayCluster Dagster creates runs the run's own image.

    The manifest names `tessera:latest` so that `kubectl apply` can start a long-lived cluster.
    dagster-ray fills in a group's Ray container image (its first container) only where the spec has
    none, from the run's `dagster/image` tag, which the K8sRunLauncher sets to the image of the run
    pod. So the spec Dagster creates clusters from leaves it out: a run of `registry/tessera:<sha>`
    gets Ray pods of that image, as Ray Client needs (same Python, Ray and Tessera code)."""
    without_images = copy.deepcopy(load_raycluster_manifest(manifest))
    spec = without_images["spec"]
    for group in (spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])):
        group["template"]["spec"]["containers"][0].pop("image", None)
    if ephemeral:  # dagster-ray names a cluster per step when the spec names none
        without_images["metadata"].pop("name", None)
    # `ray_cluster` is a KubeRayCluster field: passed on, it replaces the spec read from the file.
    return kuberay_cluster_from_manifest(
        manifest, ephemeral=ephemeral, ray_cluster=raycluster_config_from_manifest(without_images)
    )


def kubernetes_resources() -> dict:
    # Bound for configuration at launch, so a run config's `storage` settings reach the cache and
    # MLflow resources too (a configured instance would stay behind inside them).
    storage = TesseraStorage.configure_at_launch(ray_storage_uri=dg.EnvVar("TESSERA_RAY_STORAGE"))
    return {
        "storage": storage,
        # values between steps, written atomically, where the next step's pod can read them: Dagster's
        # part of the state, which stays with the code location's TESSERA_HOME whatever a run sets
        "io_manager": AtomicFilesystemIOManager(base_dir=step_values_dir(TesseraStorage())),
        "ray_cluster": kuberay_cluster_on_the_run_image(),
        "mlflow_tracker": MlflowTracker(storage=storage, tracking_uri=dg.EnvVar("MLFLOW_TRACKING_URI")),
        "cache": RowGroupCache(storage=storage),
        "run_process": RunProcess(),  # tags runs with their step pods' processes: never judged from another host
    }
