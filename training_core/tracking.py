"""MLflow: one training run per `lora_adapter` materialization, with the full lineage record.

Tracking in SQLite (MLflow 3.13+ rejects the file store), artifacts in a local folder. MLflow and
the plotting stack are imported when a client is made, not with this module: the code location
imports it, and every Dagster process (code server, each run) would pay ~2 s for them."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from training_core.errors import ConfigError, TesseraError
from training_core.lineage import LARGEST_CODE_PATCH, REPO_ROOT, CodeChanges, hardware_tags, uncommitted_code_changes
from training_core.redaction import redact_uri

log = logging.getLogger(__name__)

PROCESS_TAG = "tessera.process"  # host:pid:start time of the process that started the run
FAILURE_TAG = "tessera.failure"  # "Type: message" of the error a FAILED run ended with
ENDED_BY_TAG = "tessera.ended_by"  # what stopped a KILLED run from outside: "<who>: <how>"


# MLflow's defaults (120 s a request, 7 retries with backoff, POSTs too) hold a call to a server that never
# answers for ~20 min. Ours: 4 tries of 30 s plus backoff, ~2¼ min; a refused connection still rides out a
# ~14 s restart. An operator's own values win; MLflow reads them per request, so late is in time.
MLFLOW_HTTP_BUDGET = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "30", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
                      "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "2"}


def bound_mlflow_http_requests(tracking_uri: str) -> int:
    """Sets `MLFLOW_HTTP_BUDGET` where the operator has not, for an http(s) URI; returns the timeout in effect (s)."""
    from urllib.parse import urlparse

    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_TIMEOUT

    if urlparse(tracking_uri).scheme.split("+")[0] in ("http", "https"):
        for name, value in MLFLOW_HTTP_BUDGET.items():
            os.environ.setdefault(name, value)
    return MLFLOW_HTTP_REQUEST_TIMEOUT.get()


def server_did_not_answer(error: BaseException | None) -> BaseException | None:
    """The connection error or timeout behind ``error`` (or an error it was raised from) when it is
    MLflow's HTTP client getting no answer from the tracking server; otherwise None."""
    from mlflow.exceptions import MlflowException
    from requests.exceptions import ConnectionError as NoConnection, Timeout

    while error is not None:  # Python breaks cycles in the chain it makes
        cause = error.__cause__ or error.__context__
        if isinstance(error, MlflowException) and isinstance(cause, (NoConnection, Timeout)):
            return getattr(cause.args[0], "reason", cause) if cause.args else cause  # urllib3's, not "Max retries"
        error = cause
    return None


class RunNotRecordedError(TesseraError):
    """Training finished and published its model, but MLflow did not take the run's results."""


def interruption(error: BaseException) -> str | None:
    """What stopped the run, when ``error`` is a stop from outside rather than a failure of the run:
    Ctrl-C, a signal, or Dagster's Terminate (named, not imported: training_core has no Dagster)."""
    if any(cls.__name__ == "DagsterExecutionInterruptedError" for cls in type(error).__mro__):
        return "Dagster's Terminate (DagsterExecutionInterruptedError)"
    if isinstance(error, KeyboardInterrupt):
        return "Ctrl-C (KeyboardInterrupt)"
    if isinstance(error, SystemExit):  # what ray.get turns Ctrl-C or SIGTERM into while the driver waits
        return f"a signal to stop, such as Ctrl-C or SIGTERM (SystemExit: {error.code})"
    return None


def _check_artifact_location(experiment: str, location: str, artifact_root: Path) -> None:
    """A local experiment whose artifacts live outside this deployment's artifact folder
    (the state folder was moved, or two deployments share a database) would write every new run's
    artifacts there: refuse, naming both. Artifacts in an object store are the server's business."""
    from urllib.parse import unquote, urlparse

    parsed = urlparse(location)
    if parsed.scheme not in ("", "file"):
        return
    recorded = Path(unquote(parsed.path))
    # Inside it is fine: an experiment made in the MLflow UI of `make ui` keeps <root>/<id>.
    if not recorded.resolve().is_relative_to(artifact_root.resolve()):
        raise ConfigError(
            f"MLflow experiment {experiment!r} keeps its artifacts in {recorded}, not in this deployment's "
            f"{artifact_root}: was the state folder moved? New runs would write outside it and earlier "
            "runs' models could not be loaded; move it back, or use another experiment name or database"
        )


def _write_code_changes(changes: CodeChanges, folder: Path, run_id: str) -> None:
    if changes.patch is not None:
        (folder / "code_changes.patch").write_bytes(changes.patch)
        return
    # A truncated patch applies to nothing: name the files instead, and say why there is no patch.
    log.warning("MLflow run %s: its uncommitted code changes exceed %d MiB and are not saved; commit them to "
                "keep them recoverable", run_id, LARGEST_CODE_PATCH // 2**20)
    (folder / "code_changes_not_saved.txt").write_text(
        f"The uncommitted changes to these files are over {LARGEST_CODE_PATCH // 2**20} MiB as a patch, so no "
        "patch was saved; this run's code cannot be recovered from MLflow.\n" + "\n".join(changes.files) + "\n")


def restore_credentials_hint(tracking_uri: str) -> str:
    """Said after a command that names the tracking URI redacted: run it with the real credentials."""
    if redact_uri(tracking_uri) == tracking_uri:
        return ""
    return " (with MLFLOW_TRACKING_URI as configured where this shows ***)"


def _why_abandoned(run, run_has_ended: Callable[[str], str | None] | None) -> str | None:
    """What shows that a RUNNING MLflow run's process can no longer end it (the `ENDED_BY_TAG`
    value), or None while nothing does."""
    from training_core.process_identity import process_is_gone

    if process_is_gone(run.data.tags.get(PROCESS_TAG, "")):
        return "a later run: its process was gone"
    dagster_run_id = run.data.params.get("dagster_run_id", "")  # the lineage record's; "" outside Dagster
    if run_has_ended is None or not dagster_run_id:
        return None
    if (status := run_has_ended(dagster_run_id)) is None:
        return None
    return f"a later run: its Dagster run {dagster_run_id} had ended ({status})"


class MlflowTracking:
    def __init__(self, tracking_uri: str, artifact_root: Path, experiment: str = "tessera",
                 create_missing: bool = True):
        """``create_missing=False``: a missing experiment is not created and ``experiment_id`` is None,
        for a caller that only reads runs until it knows which experiment it logs to (`tessera
        reproduce` logs beside the run it reproduces, and must not leave an empty experiment behind)."""
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        bound_mlflow_http_requests(tracking_uri)
        self.client = MlflowClient(tracking_uri)
        existing = self.client.get_experiment_by_name(experiment)
        self.experiment_id: str | None = None
        if existing is None and not create_missing:
            return
        if existing is None:
            artifact_root.mkdir(parents=True, exist_ok=True)
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=artifact_root.resolve().as_uri())
        elif existing.lifecycle_stage == "deleted":  # MLflow refuses new runs in it, and lists none of its runs
            shown = redact_uri(tracking_uri)
            raise ConfigError(
                f"MLflow experiment {experiment!r} (id {existing.experiment_id}) at {shown} is deleted: restore it "
                f"with `MLFLOW_TRACKING_URI={shown} mlflow experiments restore --experiment-id "
                f"{existing.experiment_id}`{restore_credentials_hint(tracking_uri)} (its runs come back with "
                "it), or name another experiment (the mlflow_tracker resource's experiment)")
        else:
            self.experiment_id = existing.experiment_id
            _check_artifact_location(experiment, existing.artifact_location, artifact_root)

    def start_run(self, run_name: str, tags: dict[str, str]) -> str:
        from training_core.process_identity import this_process

        tags = {PROCESS_TAG: this_process(), **tags}
        return self.client.create_run(self.experiment_id, run_name=run_name, tags=tags).info.run_id

    def end_abandoned_runs(self, run_has_ended: Callable[[str], str | None] | None = None) -> list[str]:
        """Mark KILLED the RUNNING runs whose process is gone (killed mid-training: it could not
        end its run), so the MLflow UI does not show them running forever. Returns their ids.
        A process on another host is never judged from here, and on Kubernetes every step pod is
        one: ``run_has_ended`` (given by the Dagster side) judges those by their lineage's
        ``dagster_run_id`` instead, returning the status that Dagster run ended with, or None while
        it is still going or unknown."""
        from mlflow.entities import ViewType

        running = self.client.search_runs([self.experiment_id], "attributes.status = 'RUNNING'",
                                          run_view_type=ViewType.ACTIVE_ONLY, max_results=1000)
        abandoned = []
        for run in running:
            if (ended_by := _why_abandoned(run, run_has_ended)) is not None:
                self.client.set_tag(run.info.run_id, ENDED_BY_TAG, ended_by)
                self.client.set_terminated(run.info.run_id, status="KILLED")
                abandoned.append(run.info.run_id)
        return abandoned

    def log_lineage(self, run_id: str, *, lineage: dict[str, str], config: dict, dataset_paths: list[str],
                    repo_root: Path = REPO_ROOT) -> None:
        """What the run is made of, logged before it trains: a run that fails or is killed still
        says which data, config, seeds and code it ran with, and on which machine (tags). Code with
        uncommitted changes (``repo_root``'s) is saved as ``code_changes.patch``: its
        ``<sha>-dirty-<hash>`` code version names no commit to check out."""
        self.log_batch(run_id, params=lineage, tags=hardware_tags())
        for path in dataset_paths:
            self._log_dataset_input(run_id, path, Path(path).name)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            (folder / "training_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
            (folder / "lineage.json").write_text(json.dumps(lineage, indent=2, sort_keys=True))
            if (changes := uncommitted_code_changes(repo_root)) is not None:
                _write_code_changes(changes, folder, run_id)
            self.client.log_artifacts(run_id, str(folder))

    def log_training(self, run_id: str, *, result) -> None:
        """What the run produced: metrics, loss curve, plots, DeepSpeed config and the model. Raises
        ``RunNotRecordedError`` naming the published model folder when MLflow does not take them."""
        try:
            self._log_training(run_id, result)
        except Exception as error:  # the model is on disk: say where, or the operator only sees MLflow's error
            raise RunNotRecordedError(
                f"MLflow run {run_id}: training finished and its model is published at {result.model_dir}, but it "
                f"was not recorded in MLflow at {redact_uri(self.tracking_uri)} (mlflow_tracker.tracking_uri): "
                f"{type(error).__name__}: {redact_uri(str(error))}") from error

    def _log_training(self, run_id: str, result) -> None:
        from training_core.plots import plot_loss_curve, plot_step_time
        from training_core.train.telemetry import THROUGHPUT_COUNTING

        client = self.client
        numeric = {k: float(v) for k, v in result.telemetry.items() if isinstance(v, (int, float))}
        summary = {**numeric, "restarts": result.restarts, "steps": result.steps}
        self.log_batch(
            run_id,
            metrics=summary,
            series={"train_loss": result.loss_history},
            tags={"model_dir": result.model_dir, "tessera.throughput_counting": THROUGHPUT_COUNTING},
        )
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            (folder / "deepspeed_config.json").write_text(json.dumps(result.deepspeed_config, indent=2, sort_keys=True))
            plot_loss_curve(result.loss_history, folder / "loss_curve.png")
            plot_step_time(result.telemetry, folder / "step_time.png")
            client.log_artifacts(run_id, str(folder))
        client.log_artifacts(run_id, result.model_dir, artifact_path="model")

    def _log_dataset_input(self, run_id: str, dataset_path: str, digest: str) -> None:
        from mlflow.data.dataset_source_registry import resolve_dataset_source
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "source can be interpreted in multiple ways" is harmless
            source = resolve_dataset_source(dataset_path)
        dataset = MetaDataset(source=source, name="training_dataset", digest=digest[:36])
        self.client.log_inputs(run_id, datasets=[DatasetInput(dataset._to_mlflow_entity())])

    def loss_history(self, run_id: str) -> list[tuple[int, float]]:
        """The run's train-loss curve as (step, loss), in step order."""
        history = self.client.get_metric_history(run_id, "train_loss")
        return [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)]

    def log_metrics(self, run_id: str, metrics: dict[str, float]) -> None:
        self.log_batch(run_id, metrics=metrics)

    def log_batch(
        self,
        run_id: str,
        *,
        params: dict[str, str] | None = None,
        metrics: dict[str, float] | None = None,
        series: dict[str, list[tuple[int, float]]] | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        """Params, single metrics (step 0), metric series ``(step, value)`` and tags in one
        ``log_batch`` (MLflow splits it to its per-request limits): a transaction per chunk instead
        of one SQLite round trip per value, which for a 1 000-step loss curve was 1 000 of them."""
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        metric_list = [Metric(key, float(value), now, 0) for key, value in (metrics or {}).items()]
        for key, points in (series or {}).items():
            metric_list += [Metric(key, float(value), now, int(step)) for step, value in points]
        self.client.log_batch(
            run_id,
            metrics=metric_list,
            params=[Param(key, str(value)) for key, value in (params or {}).items()],
            tags=[RunTag(key, str(value)) for key, value in (tags or {}).items()],
        )

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """End the run with ``status``. A run that another process's sweep (:meth:`end_abandoned_runs`)
        marked KILLED while it still ran, and that ends now by itself, loses that sweep's `tessera.ended_by`
        tag: it would tell whoever reads a FINISHED (or FAILED) run that something stopped it."""
        if status != "KILLED" and (swept_by := self.client.get_run(run_id).data.tags.get(ENDED_BY_TAG)):
            log.warning("MLflow run %s was marked KILLED (by %s) while it still ran: it ended %s by itself",
                        run_id, swept_by, status)
            self.client.delete_tag(run_id, ENDED_BY_TAG)
        self.client.set_terminated(run_id, status=status)

    def end_failed_run(self, run_id: str, error: BaseException) -> bool:
        """End the run FAILED, saying why in its `tessera.failure` tag: ``Type: message``, with the
        credentials of any URI in it redacted, cut to MLflow's longest tag value. A diverged run's
        finite losses up to the failure (``TrainingDivergedError.loss_history``) become its
        ``train_loss`` curve: the curve is where one looks for why it diverged. Best effort (see
        :meth:`_end_as_best_it_can`); returns whether the run ended."""
        from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

        reason = redact_uri(f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
        if len(reason) > MAX_TAG_VAL_LENGTH:
            reason = reason[: MAX_TAG_VAL_LENGTH - 1] + "…"
        curve = getattr(error, "loss_history", None)
        def log_curve() -> None:
            self.log_batch(run_id, series={"train_loss": curve})

        losses = [("record its losses up to the failure", log_curve)] if curve else []
        return self._end_as_best_it_can(run_id, "FAILED", (FAILURE_TAG, reason), server_did_not_answer(error), losses)

    def end_interrupted_run(self, run_id: str, stopped_by: str) -> bool:
        """End the run KILLED, MLflow's status for a run stopped from outside, with `tessera.ended_by`
        naming what stopped it (:func:`interruption`): a stop is not a crash to debug. Best effort."""
        return self._end_as_best_it_can(run_id, "KILLED", (ENDED_BY_TAG, f"an interruption: {stopped_by}"), None)

    def _end_as_best_it_can(self, run_id: str, status: str, tag: tuple[str, str],
                            no_answer: BaseException | None, records: list | None = None) -> bool:
        """Tag why the run ends (after ``records``: (what, call) pairs of what else to log), then end it.
        The run's own error is the one to raise, so a failure here is a warning. Once the server gave
        no answer (to the call the run failed in, or to one of these), the rest is skipped: each call
        would wait out MLflow's whole HTTP budget again."""
        calls = [*(records or []), ("record why it ended", lambda: self.client.set_tag(run_id, *tag)),
                 (f"end it {status}", lambda: self.end_run(run_id, status=status))]
        ended = False
        for what, call in calls:
            if no_answer is not None:
                break
            try:
                call()
                ended = what.startswith("end")
            except Exception as failure:  # noqa: BLE001 - the run's own error is the one to raise
                if (no_answer := server_did_not_answer(failure)) is None:
                    log.warning("MLflow run %s: could not %s (%s)", run_id, what, redact_uri(str(failure)))
        if no_answer is not None:
            log.warning("MLflow run %s stays RUNNING: the tracking server %s gave no answer (%s: %s), so it was "
                        "not ended %s; the next training marks it KILLED once this process has ended", run_id,
                        redact_uri(self.tracking_uri), type(no_answer).__name__, redact_uri(str(no_answer)), status)
        return ended

    def run_url(self, run_id: str, ui_base: str = "http://127.0.0.1:5000") -> str:
        return f"{ui_base}/#/experiments/{self.experiment_id}/runs/{run_id}"
