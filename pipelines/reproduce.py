"""`tessera reproduce RUN_ID`: rerun a recorded training run and print a side-by-side diff."""

import uuid

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from resources import MlflowTracker, RowGroupCache, TesseraStorage
from training_core.data.window import eval_records
from training_core.errors import LineageError
from training_core.evaluate.compare import EvaluationReport, evaluate_against_base
from training_core.reproduce import compare_runs, lineage_drift, load_recorded_run
from training_core.runs import run_tracked_training


def reproduce_run(run_id: str, console: Console) -> int:
    import ray

    storage = TesseraStorage()
    tracking = MlflowTracker(storage=storage).client()
    try:
        recorded = load_recorded_run(tracking, run_id, str(RowGroupCache(storage=storage).config().directory))
    except LineageError as error:
        console.print(f"[red]cannot reproduce:[/] {escape(str(error))}")  # paths and JSON may hold "[...]"
        return 2
    print_drift(console, run_id, lineage_drift(recorded.params))
    if not ray.is_initialized():
        ray.init(logging_level="warning")
    tracked = run_tracked_training(
        recorded.config, recorded.inputs, tracking, ray_storage=storage.ray_storage,
        models_dir=storage.folder("models") / "trained", extra_tags={"reproduces": run_id},
        run_name_suffix=f"reproduce-{uuid.uuid4().hex[:8]}", reuse_finished=False,
    )
    records = eval_records(recorded.inputs.dataset_paths)
    base, trained = evaluate_against_base(recorded.inputs.base_model, tracked.result.model_dir, records)
    report = EvaluationReport(base, trained, tracked.result.model_dir, tracked.mlflow_run_id)
    tracking.log_metrics(tracked.mlflow_run_id, report.as_metrics())
    rows = compare_runs(tracking, run_id, tracked.mlflow_run_id)
    table = Table(title=f"reproduce {run_id} → {tracked.mlflow_run_id}")
    for column in ("metric", "original", "reproduced", "match"):
        table.add_column(column)
    for name, a, b, equal in rows:
        table.add_row(name, _fmt(a), _fmt(b), "[green]yes[/]" if equal else "[red]NO[/]")
    console.print(table)
    return 0 if all(equal for *_, equal in rows) else 1


def print_drift(console: Console, run_id: str, drift: list[tuple[str, str, str]]) -> None:
    """Code and package versions that changed since the run: a warning (metrics may then differ)."""
    if not drift:
        return
    console.print(f"[yellow]note:[/] run {run_id} was recorded with other versions than this environment; "
                  f"metrics may differ:")
    for key, recorded, now in drift:
        console.print(f"  {key}: {recorded} → {now}", markup=False, highlight=False)


def _fmt(value) -> str:
    return "—" if value is None else f"{value:.6g}"
