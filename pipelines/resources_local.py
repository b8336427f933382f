"""Resource wiring: local defaults; production values come from the environment via EnvVar."""


from resources import LocalRayCluster, MlflowTracker, RowGroupCache, TesseraStorage


def local_resources() -> dict:
    storage = TesseraStorage()
    return {
        "storage": storage,
        "ray_cluster": LocalRayCluster(ray_init_options={"logging_level": "warning"}),
        "mlflow_tracker": MlflowTracker(storage=storage),
        "cache": RowGroupCache(storage=storage),
    }
