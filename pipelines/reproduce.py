"""`tessera reproduce RUN_ID`: rerun a recorded training run and print a side-by-side diff."""

import dataclasses
import os
import re
import shutil
import uuid
from pathlib import Path

import dagster as dg
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pipelines.resources_local import RAY_ADDRESS_ENV, local_resources
from resources import MlflowTracker, TesseraStorage
from resources.paths import RAY_STORAGE_ENV
from resources.ray_cluster import (
    RayClusterUnreachable,
    RayResource,
    check_cluster_capacity,
    connect_unless_connected,
    gpu_available_in_cluster,
)
from training_core.data.dataset_writer import read_prompt_format
from training_core.data.window import eval_records
from training_core.errors import ConfigError, LineageError, TesseraError
from training_core.evaluate.compare import EvaluationReport, evaluate_against_base
from training_core.process_identity import process_is_gone, this_process
from training_core.redaction import redact_uri
from training_core.reproduce import compare_runs, lineage_drift, load_recorded_run
from training_core.runs import run_tracked_training
from training_core.tracking import MlflowTracking

# The long-lived RayCluster of deploy/kuberay/raycluster.yaml (tessera-ray in namespace tessera), by Ray Client.
KUBERAY_CLIENT_ADDRESS = "ray://tessera-ray-head-svc.tessera.svc.cluster.local:10001"
# Beside a reproduction's Ray run folder(s) `*-reproduce-<id>` in the Ray storage: `.reproduce-<id>.process`,
# holding `this_process()` of the `tessera reproduce` that trains it (written before training creates them).
REPRODUCTION_PROCESS_FILE = ".{suffix}.process"
_REPRODUCTION_PROCESS_FILE_NAME = re.compile(r"\.(reproduce-[0-9a-f]{8})\.process")


def reproduce_run(run_id: str, console: Console, tracking_uri: str | None = None) -> int:
    """``tracking_uri``: the MLflow store that recorded the run (a tracking server, as the Kubernetes
    deployment's); default the state folder's mlflow.db, as the local code location records. Only
    given explicitly: an MLFLOW_TRACKING_URI exported for other work is not where local runs are."""
    # The code location's own wiring: the same state folder, MLflow store and Ray cluster
    # (TESSERA_RAY_ADDRESS), with the Kubernetes deployment's Ray storage where it is set.
    resources = local_resources()
    storage, tracker, cache = resources["storage"], resources["mlflow_tracker"], resources["cache"]
    storage = _with_deployment_ray_storage(storage)
    if tracking_uri:
        tracker = MlflowTracker(storage=storage, tracking_uri=tracking_uri)
    store = storage.root / "mlflow.db"
    if tracker.tracking_uri is None and not store.is_file():  # MLflow would create an empty one
        console.print(f"[red]cannot reproduce:[/] no MLflow store at {escape(str(store))}; pass --home "
                      f"(or TESSERA_HOME) of the state folder that recorded run {escape(run_id)}, or --tracking-uri "
                      f"of the MLflow server that tracked it")
        return 2
    try:
        tracking = tracker.client(create_missing=False)  # the run's own experiment is logged to, below
    except TesseraError:
        raise  # already one line naming the setting or folder at fault
    except Exception as error:  # noqa: BLE001 - SQLAlchemy/driver errors of a damaged or locked store
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        console.print(f"[red]cannot reproduce:[/] cannot open the MLflow tracking store "
                      f"{escape(redact_uri(tracker.tracking_uri or str(store)))}: {escape(redact_uri(reason))} "
                      "(is it damaged, not an MLflow store, or locked by another process?)")
        return 2
    try:
        recorded = load_recorded_run(tracking, run_id, str(cache.config().directory), storage.base_model_digests)
    except LineageError as error:
        console.print(f"[red]cannot reproduce:[/] {escape(str(error))}")  # paths and JSON may hold "[...]"
        return 2
    tracking = _in_experiment_of(tracking, run_id, storage, tracker.tracking_uri)
    print_drift(console, run_id, lineage_drift(recorded.params) + recorded.config_drift)
    ray_cluster = resources["ray_cluster"]
    try:
        _connect_to_ray(ray_cluster)
    except RayClusterUnreachable as error:
        console.print(f"[red]cannot reproduce:[/] {escape(str(error))}")
        return 2
    try:  # a GPU run on a CPU-only cluster, e.g. in-process Ray in a pod of the Kubernetes deployment
        recorded.config.check_hardware(gpu_available_in_cluster())
    except ConfigError as error:
        console.print(f"[red]cannot reproduce:[/] {escape(_gpu_refusal(run_id, error, ray_cluster))}")
        return 2
    try:  # evaluated as the original was (a bf16 GPU evaluation gives other losses): checked before training
        eval_settings = recorded.eval_settings.for_this_process()
    except ConfigError as error:
        console.print(f"[red]cannot reproduce:[/] run {escape(run_id)} was evaluated with "
                      f"{escape(str(recorded.eval_settings))}: {escape(str(error))}")
        return 2
    try:  # as the training asset decides: refused if the cluster can never hold it, else waited for
        check_cluster_capacity(recorded.config, ray_cluster, _ConsoleNotes(console))
    except ConfigError as error:
        console.print(f"[red]cannot reproduce:[/] {escape(str(error))}")
        return 2
    # Read under the quota and policy the cache resource warmed it with, as lora_adapter does.
    inputs = dataclasses.replace(recorded.inputs, cache_size_limit_bytes=cache.size_limit_bytes,
                                 cache_policy=cache.policy)
    suffix = f"reproduce-{uuid.uuid4().hex[:8]}"  # a fresh run: never resumed, never reused
    ray_storage = Path(storage.ray_storage)
    for folder in remove_abandoned_reproductions(ray_storage):
        console.print(f"[yellow]note:[/] removed {escape(str(folder))}: the checkpoints of a reproduction whose "
                      "process is gone (killed before it could remove them)")
    ray_storage.mkdir(parents=True, exist_ok=True)
    (ray_storage / REPRODUCTION_PROCESS_FILE.format(suffix=suffix)).write_text(this_process())
    try:
        tracked = run_tracked_training(
            recorded.config, inputs, tracking, ray_storage=storage.ray_storage,
            models_dir=storage.folder("models") / "trained", extra_tags={"reproduces": run_id},
            run_name_suffix=suffix, reuse_finished=False, base_digest_records=storage.base_model_digests,
            base_model_checked=True,  # load_recorded_run compared it with the recorded digest
        )
    finally:
        # Nothing resumes a reproduction, so its checkpoints (engine state included) would only fill
        # the disk: removed whether it finished, failed or was interrupted (Ctrl-C); after a kill -9,
        # by the next reproduce.
        _remove_reproduction(ray_storage, suffix)
    records = eval_records(recorded.inputs.dataset_paths)
    prompt_format = read_prompt_format(recorded.inputs.dataset_paths[0])  # the training window refused a mix
    base, trained = evaluate_against_base(recorded.inputs.base_model, tracked.result.model_dir, records, eval_settings,
                                          prompt_format)
    report = EvaluationReport(base, trained, tracked.result.model_dir, tracked.mlflow_run_id)
    tracking.log_batch(tracked.mlflow_run_id, metrics=report.as_metrics(), tags=eval_settings.as_tags())
    rows = compare_runs(tracking, run_id, tracked.mlflow_run_id)
    console.print(comparison_table(run_id, tracked.mlflow_run_id, rows))
    return 0 if all(equal is not False for *_, equal in rows) else 1


def remove_abandoned_reproductions(ray_storage: Path) -> list[Path]:
    """Remove the Ray run folders of earlier reproductions whose process is certainly gone (see
    `process_is_gone`: never one still running, nor one started on another host), with their process
    files. Returns the folders removed. Training runs' folders, which have no process file, are kept."""
    removed = []
    for process_file in ray_storage.glob(REPRODUCTION_PROCESS_FILE.format(suffix="reproduce-*")):
        if (name := _REPRODUCTION_PROCESS_FILE_NAME.fullmatch(process_file.name)) is None:
            continue  # not one reproduce writes: its suffix could name other runs' folders
        try:
            identity = process_file.read_text().strip()
        except OSError:
            continue  # removed meanwhile by another reproduce's sweep, or unreadable: not ours to judge
        if process_is_gone(identity):
            removed += _remove_reproduction(ray_storage, name.group(1))
    return removed


def _remove_reproduction(ray_storage: Path, suffix: str) -> list[Path]:
    """Its run folders, then its process file (kept while a folder could not be removed: a removal
    cut short is finished by a later sweep). Returns the folders removed."""
    folders = sorted(ray_storage.glob(f"*-{suffix}"))
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    if any(folder.exists() for folder in folders):
        return [folder for folder in folders if not folder.exists()]
    (ray_storage / REPRODUCTION_PROCESS_FILE.format(suffix=suffix)).unlink(missing_ok=True)
    return folders


def comparison_table(run_id: str, reproduced_id: str, rows) -> Table:
    """Metrics side by side, 6 significant digits where they match; where they differ, every digit
    (a difference of 4e-10 otherwise showed the same number twice, marked NO)."""
    table = Table(title=f"reproduce {run_id} → {reproduced_id}")
    for column in ("metric", "original", "reproduced", "match"):
        table.add_column(column)
    for name, a, b, equal in rows:
        match = "not recorded" if equal is None else "[green]yes[/]" if equal else "[red]NO[/]"
        table.add_row(name, _fmt(a, every_digit=equal is False), _fmt(b, every_digit=equal is False), match)
    return table


def _with_deployment_ray_storage(storage: TesseraStorage) -> TesseraStorage:
    """``storage`` with TESSERA_RAY_STORAGE as its Ray storage when set, as the Kubernetes code location
    reads it (ConfigMap tessera-config): the folder on the volume the Ray pods mount."""
    ray_storage = os.environ.get(RAY_STORAGE_ENV)
    return TesseraStorage(home=storage.home, ray_storage_uri=ray_storage) if ray_storage else storage


def _in_experiment_of(tracking: MlflowTracking, run_id: str, storage: TesseraStorage,
                      tracking_uri: str | None) -> MlflowTracking:
    """Tracking that logs into the recorded run's MLflow experiment: the reproduction sits beside the
    original (tag ``reproduces``), whatever experiment the run config's mlflow_tracker named."""
    experiment_id = tracking.client.get_run(run_id).info.experiment_id
    if experiment_id == tracking.experiment_id:
        return tracking
    experiment = tracking.client.get_experiment(experiment_id).name
    return MlflowTracker(storage=storage, tracking_uri=tracking_uri, experiment=experiment).client()


def _gpu_refusal(run_id: str, error: ConfigError, ray_cluster: RayResource) -> str:
    where = ("in-process Ray on this machine" if ray_cluster.ray_address == "local"
             else f"{RAY_ADDRESS_ENV}={ray_cluster.ray_address}")
    return (f"run {run_id}: {error} in the Ray cluster it would train on ({where}). To reproduce it on GPUs, "
            f"set {RAY_ADDRESS_ENV} to the head of a cluster with GPU nodes (HOST:PORT, or ray://HOST:10001 "
            f"through Ray Client); in a pod of the Kubernetes deployment, {RAY_ADDRESS_ENV}={KUBERAY_CLIENT_ADDRESS} "
            "(the RayCluster of deploy/kuberay/raycluster.yaml; see docs/scaling_out.md)")


def _connect_to_ray(ray_cluster: RayResource) -> None:
    """As the training asset connects: in-process Ray, or the cluster at TESSERA_RAY_ADDRESS, each
    with the settings of its resource (unless this process already runs Ray). The context, which
    dagster-ray logs through, brings an in-memory Dagster instance: nothing is written."""
    with dg.build_init_resource_context() as context:
        connect_unless_connected(ray_cluster, context)


class _ConsoleNotes:
    """The log `check_cluster_capacity` warns through, printing to the console as reproduce's notes."""

    def __init__(self, console: Console) -> None:
        self._console = console

    def warning(self, message: str) -> None:
        self._console.print(f"[yellow]note:[/] {escape(message)}")


def print_drift(console: Console, run_id: str, drift: list[tuple[str, str, str]]) -> None:
    """Code and package versions that changed since the run, and config fields it did not record
    (filled from today's defaults): a warning (metrics may then differ)."""
    if not drift:
        return
    console.print(f"[yellow]note:[/] run {run_id} was recorded with other versions or settings than this "
                  f"environment's; metrics may differ:")
    for key, recorded, now in drift:
        console.print(f"  {key}: {recorded} → {now}", markup=False, highlight=False)


def _fmt(value, every_digit: bool = False) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):  # already shown as it should be (the loss curve's cells)
        return value
    if every_digit:
        return str(int(value)) if float(value).is_integer() else repr(float(value))  # shortest exact form
    return f"{value:.6g}"
