"""Resource wiring for the local code location: in-process Ray unless TESSERA_RAY_ADDRESS names a
running cluster (`ray start --head`), SQLite MLflow and the row-group cache under $TESSERA_HOME."""

import os

from dagster_ray import Lifecycle

from resources import ExternalRayCluster, LocalRayCluster, MlflowTracker, RowGroupCache, RunProcess, TesseraStorage
from resources.io_manager import AtomicFilesystemIOManager

RAY_ADDRESS_ENV = "TESSERA_RAY_ADDRESS"
LAZY = Lifecycle(connect=False)


def local_resources(storage_set_at_launch: bool = False) -> dict:
    """The code location's resources. With ``storage_set_at_launch`` (the definitions) the state
    folder is bound for configuration at launch, so a run config's ``storage`` settings reach the
    cache and MLflow resources too (a configured instance would stay behind inside them); without it
    (`tessera reproduce`, tests) every resource is ready to use from Python."""
    storage = TesseraStorage.configure_at_launch() if storage_set_at_launch else TesseraStorage()
    address = os.environ.get(RAY_ADDRESS_ENV)
    return {
        "storage": storage,
        "io_manager": AtomicFilesystemIOManager(),  # values between steps, written atomically
        # connect=False: the training asset connects only when it really trains (not for a reuse).
        # Passed explicitly: the resources' field defaults are not applied when Dagster builds them.
        "ray_cluster": ExternalRayCluster(address=address, lifecycle=LAZY) if address
        else LocalRayCluster(ray_init_options={"logging_level": "warning"}, lifecycle=LAZY, preemption_watcher=False),
        "mlflow_tracker": MlflowTracker(storage=storage),
        "cache": RowGroupCache(storage=storage),
        "run_process": RunProcess(),
    }
