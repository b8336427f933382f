"""Resource wiring for the local code location: in-process Ray unless TESSERA_RAY_ADDRESS names a
running cluster (`ray start --head`), SQLite MLflow and the row-group cache under $TESSERA_HOME."""

import os

from resources import ExternalRayCluster, LocalRayCluster, MlflowTracker, RowGroupCache, TesseraStorage

RAY_ADDRESS_ENV = "TESSERA_RAY_ADDRESS"


def local_resources() -> dict:
    storage = TesseraStorage()
    address = os.environ.get(RAY_ADDRESS_ENV)
    return {
        "storage": storage,
        "ray_cluster": ExternalRayCluster(address=address) if address
        else LocalRayCluster(ray_init_options={"logging_level": "warning"}),
        "mlflow_tracker": MlflowTracker(storage=storage),
        "cache": RowGroupCache(storage=storage),
    }
