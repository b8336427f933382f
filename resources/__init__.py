from resources.mlflow_tracker import MlflowTracker
from resources.paths import TesseraStorage
from resources.ray_cluster import ExternalRayCluster, LocalRayCluster
from resources.row_group_cache import RowGroupCache
from resources.run_process import RunProcess

__all__ = ["ExternalRayCluster", "LocalRayCluster", "MlflowTracker", "RowGroupCache", "RunProcess", "TesseraStorage"]
