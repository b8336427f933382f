"""The MLflow model registry entries Tessera promotes: which run is champion, what it was trained on,
and how a promoted model is loaded. Tracking of the runs themselves is :mod:`training_core.tracking`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from training_core.errors import LineageError

if TYPE_CHECKING:
    from training_core.tracking import MlflowTracking


class ModelRegistry:
    """The MLflow model registry entries Tessera promotes: one registered model, one alias."""

    def __init__(self, tracking: MlflowTracking, name: str = "tessera-adapter", alias: str = "champion",
                 base_digest_records: Path | None = None):
        self.client, self.name, self.alias = tracking.client, name, alias
        # Per-file digests of users' base-model folders (TesseraStorage.base_model_digests), as training
        # checks them: they name the files of a champion's base model that changed since it trained.
        self.base_digest_records = base_digest_records

    def champion(self):
        """The model version the alias points at, or None before the first promotion."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_model_version_by_alias(self.name, self.alias)
        except MlflowException:
            return None

    def trained_for_day(self, version) -> str | None:
        """The partition a registered version trained for: the last day of its run's training window
        (lineage param `partition_keys`). None when its run is gone or recorded none."""
        from mlflow.exceptions import MlflowException

        from training_core.lineage import parse_partition_keys

        try:
            days = parse_partition_keys(self.client.get_run(version.run_id).data.params.get("partition_keys", ""))
        except MlflowException:
            return None
        return days[-1] if days else None

    def base_model_of(self, version) -> str:
        """The base model a registered version was trained on (its run's lineage). A hub model is
        recorded as its snapshot folder in the Hugging Face cache of the machine that trained it; when
        that folder is not here (cache cleaned, another HF_HOME or machine), the recorded commit is
        fetched again (from the cache, or the hub unless HF_HUB_OFFLINE). Raises ``LineageError`` naming
        the version and run when that run is gone (deleted, then removed by ``mlflow gc``), recorded no
        ``base_model`` param, its hub commit cannot be had, or its local base-model folder no longer holds
        the recorded digest (replaced in place: the version over those weights is another model). Other
        MLflow errors (a tracking server that does not answer) propagate: they say nothing about the version."""
        from mlflow.exceptions import MlflowException

        from training_core.base_model import HubRevision, pinned_snapshot

        try:
            run = self.client.get_run(version.run_id)
        except MlflowException as error:
            if error.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            raise LineageError(
                f"{self._describe(version)}: its run is not in the tracking store (deleted and garbage-collected, "
                "or logged to another store), so its base model is unknown") from error
        base_model = run.data.params.get("base_model")
        if not base_model:
            raise LineageError(f"{self._describe(version)}: its run records no 'base_model' param, so its base "
                               "model is unknown")
        digest = run.data.params.get("base_model_digest", "")
        hub = HubRevision.from_digest(digest)
        if hub is None:
            self._check_base_model_unchanged(version, Path(base_model), digest)
            return base_model
        if hub.commit is None:
            return base_model
        try:
            return str(pinned_snapshot(hub, Path(base_model)))
        except (OSError, ValueError) as error:  # not cached offline, gone from the hub, no network
            raise LineageError(
                f"{self._describe(version)}: its base model {hub.repo_id} at commit {hub.commit} cannot be loaded: "
                f"not at the recorded {base_model}, and not to be had from the Hugging Face cache or hub "
                f"({type(error).__name__}: {error})") from error

    def _check_base_model_unchanged(self, version, folder: Path, digest: str) -> None:
        """As training checks its base model before it trains or reuses a run (training_core.runs)."""
        from training_core.base_model import base_model_changes

        if not digest or not folder.is_dir():
            return  # recorded before the digest was; a folder that is gone is named when it is loaded
        if changes := base_model_changes(folder, digest, self.base_digest_records):
            raise LineageError(
                f"{self._describe(version)}: its base model {folder} changed since that run trained on it "
                f"({', '.join(changes)}), so the version as trained cannot be loaded: over the weights there now "
                "it is another model")

    def download(self, version, destination: Path) -> str:
        """The local model dir of a registered version, e.g. the `champion()` (its base model:
        :meth:`base_model_of`). Raises ``LineageError`` naming the version and run when its model
        artifacts are gone."""
        from mlflow.exceptions import MlflowException

        try:
            local = self.client.download_artifacts(version.run_id, "model", str(destination))
        except (MlflowException, OSError) as error:
            raise LineageError(f"{self._describe(version)}: its model artifacts cannot be downloaded "
                               f"({type(error).__name__}: {error})") from error
        return local

    def _describe(self, version) -> str:
        return f"{self.name} version {version.version} (MLflow run {version.run_id}), alias {self.alias!r}"

    def promote(self, run_id: str) -> tuple[str, bool]:
        """Register the run's model and move the alias to it. Returns (version, changed); promoting
        the current champion again changes nothing. A run whose model artifacts hold no model is
        refused (``LineageError``) before anything is registered."""
        from mlflow.exceptions import MlflowException

        current = self.champion()
        if current is not None and current.run_id == run_id:
            return str(current.version), False
        try:
            kind = self.model_kind(run_id)
        except LineageError as error:  # checked first: a version over missing files is worse than none
            raise LineageError(f"not promoting: {error}; nothing was registered, {self.alias!r} stays where it is"
                               ) from error
        try:
            self.client.get_registered_model(self.name)
        except MlflowException:
            self.client.create_registered_model(self.name)
        version = self._registered_version(run_id)
        if version is None:
            run = self.client.get_run(run_id)
            version = self.client.create_model_version(self.name, f"{run.info.artifact_uri}/model", run_id=run_id,
                                                       description=self._how_to_load(run_id, kind))
        self._label(version, kind)
        self.client.set_registered_model_alias(self.name, self.alias, version.version)
        return str(version.version), True

    def model_kind(self, run_id: str) -> str:
        """``peft-adapter`` or ``full-model``: what the run's ``model`` artifact holds. Both kinds
        share one registered model (the name predates full fine-tuning), so consumers read this.
        Raises ``LineageError`` naming the run and its artifact folder when that holds neither."""
        names = {Path(info.path).name for info in self.client.list_artifacts(run_id, "model")}
        if "adapter_config.json" in names:
            return "peft-adapter"
        if "config.json" in names:
            return "full-model"
        found = f"it holds {', '.join(sorted(names))}" if names else "it is empty or gone"
        raise LineageError(
            f"MLflow run {run_id}: its model artifacts ({self.client.get_run(run_id).info.artifact_uri}/model) hold "
            f"neither adapter_config.json (a PEFT adapter) nor config.json (a full model): {found}; train the model "
            "again")

    def _base_model(self, run_id: str) -> tuple[str, str]:
        """The run's base model as a reader elsewhere names it, and the from_pretrained arguments that load
        it: a hub model by repo id and commit (the recorded path is this machine's cache snapshot)."""
        from training_core.base_model import HubRevision

        params = self.client.get_run(run_id).data.params
        base = params.get("base_model", "(not recorded)")
        hub = HubRevision.from_digest(params.get("base_model_digest", ""))
        if hub is None or hub.commit is None:
            return base, repr(base)
        return f"{hub.repo_id}@{hub.commit}", f"{hub.repo_id!r}, revision={hub.commit!r}"

    def _how_to_load(self, run_id: str, kind: str) -> str:
        base, arguments = self._base_model(run_id)
        if kind == "peft-adapter":
            return (f"PEFT adapter on base model {base}: PeftModel.from_pretrained(AutoModelForCausalLM"
                    f".from_pretrained({arguments}), <this version's folder>)")
        return f"full model fine-tuned from {base}: AutoModelForCausalLM.from_pretrained(<this version's folder>)"

    def _label(self, version, kind: str) -> None:
        """Tags a version with its kind, base model and that model's recorded digest (which weights it
        needs, even after a local folder is replaced in place); set again on a finished promotion's relaunch."""
        run_id = version.run_id
        labels = {"tessera.model_kind": kind, "tessera.base_model": self._base_model(run_id)[0]}
        if base_digest := self.client.get_run(run_id).data.params.get("base_model_digest"):
            labels["tessera.base_model_digest"] = base_digest
        for key, value in labels.items():
            if version.tags.get(key) != value:
                self.client.set_model_version_tag(self.name, version.version, key, value)

    def _registered_version(self, run_id: str):
        """The version already registered for this run: a promotion killed between registering
        and moving the alias is finished on relaunch, not registered twice."""
        versions = self.client.search_model_versions(f"name = '{self.name}' and run_id = '{run_id}'")
        return min(versions, key=lambda v: int(v.version)) if versions else None
