"""MLflow tracking as a Dagster resource: SQLite + local artifacts by default, any server by URI."""


import dagster as dg
from pydantic import Field

from resources.paths import TesseraStorage
from training_core.tracking import MlflowTracking


class MlflowTracker(dg.ConfigurableResource):
    """MLflow tracking and registry for training runs (SQLite under $TESSERA_HOME unless a URI is set)."""

    storage: dg.ResourceDependency[TesseraStorage]
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; default sqlite:///<home>/mlflow.db. Credentials only via EnvVar."
    )
    experiment: str = Field("tessera", description="MLflow experiment name")
    ui_url: str = Field("http://127.0.0.1:5000", description="MLflow UI base URL, for links in Dagster")

    def client(self) -> MlflowTracking:
        uri = self.tracking_uri or f"sqlite:///{self.storage.root / 'mlflow.db'}"
        self.storage.root.mkdir(parents=True, exist_ok=True)
        return MlflowTracking(uri, self.storage.folder("mlartifacts"), self.experiment)
