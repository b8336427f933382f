"""`tessera` command line: demo, reproduce, bench."""


import argparse
import json
import logging
import os
import sys
import traceback
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pipelines.instance import (
    LAUNCHER_TAG, AbandonedRunWatch, free_training_pool, load_instance, prepare_home,
)
from training_core.process_identity import this_process

# soft_wrap: a message stays one line and a long path is never folded mid-word, so an operator
# can copy it (and a test can match it) whatever the terminal width.
console = Console(soft_wrap=True)


def demo(args: argparse.Namespace) -> int:
    if args.json:  # checked now, not after minutes of training
        target = Path(args.json).expanduser()
        if target.is_dir() or not target.parent.is_dir():
            print(f"tessera demo: --json {args.json}: needs a file path in an existing folder", file=sys.stderr)
            return 2
    root = prepare_home(args.home)
    from assets.partitions import DEMO_PARTITION
    from pipelines.definitions import defs

    console.rule(f"[bold]Tessera demo[/] — partition {DEMO_PARTITION}, state in {root}")
    job = defs.resolve_job_def("train_and_promote")
    instance = load_instance()  # a damaged dagster.yaml is named, not a YAML traceback
    _say_freed(*free_training_pool(instance))
    # also while waiting for the training slot, should its holder be killed meanwhile
    with console.status("materializing raw_examples → … → promoted_model (Dagster logs below)"), \
            AbandonedRunWatch(instance, _say_freed):
        result = job.execute_in_process(
            partition_key=DEMO_PARTITION, instance=instance, raise_on_error=False,
            tags=demo_run_tags(),
        )
    if not result.success:
        console.print("[red]demo failed[/]; see the Dagster log above")
        for step, error in step_failures(result):  # the cause, where it is seen: at the end
            console.print(f"  step {escape(step)}: {escape(error)}", highlight=False)
        return 1
    summary = _summarize(result)
    _print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str))
    return 0


def step_failures(result) -> list[tuple[str, str]]:
    """(step, "module.ErrorClass: message") of each failed step, for the last lines a user reads."""
    failures = []
    for event in result.get_step_failure_events():
        error = event.step_failure_data.error
        # Dagster wraps errors raised in a step; the user's error is the cause
        while error is not None and error.cause is not None and error.cls_name == "DagsterExecutionStepExecutionError":
            error = error.cause
        failures.append((event.step_key, error.message.strip() if error else "unknown error"))
    return failures


def _summarize(result) -> dict:
    dataset = result.output_for_node("training_dataset")
    cache = result.output_for_node("row_group_cache")
    trained = result.output_for_node("lora_adapter")
    report = result.output_for_node("evaluation")
    training_event = next(
        e for e in result.get_asset_materialization_events() if e.asset_key.path[-1] == "lora_adapter"
    )
    training_metadata = training_event.materialization.metadata
    return {
        "train_rows": dataset.train_rows,
        "dataset_digest": dataset.digest,
        "cache_version": cache.cache_version,
        "cache_hit_rate": training_metadata["cache_hit_rate"].value,
        "tokens_per_s": training_metadata["tokens_per_s"].value,
        "eval_loss_base": report.base.loss,
        "eval_loss_trained": report.trained.loss,
        "exact_match_base": report.base.exact_match,
        "exact_match_trained": report.trained.exact_match,
        "mlflow_run_id": trained.mlflow_run_id,
        "model_dir": trained.model_dir,
    }


def _print_summary(summary: dict) -> None:
    table = Table(title="Tessera demo summary", show_header=True)
    table.add_column("what")
    table.add_column("value", overflow="fold")
    table.add_row("training rows", str(summary["train_rows"]))
    table.add_row("dataset digest", summary["dataset_digest"][:16])
    table.add_row("cache version / training hit rate", f"{summary['cache_version']} / {summary['cache_hit_rate']:.2f}")
    table.add_row("train tokens/s", f"{summary['tokens_per_s']:.0f}")
    table.add_row("eval loss base → trained", f"{summary['eval_loss_base']:.3f} → {summary['eval_loss_trained']:.3f}")
    table.add_row("exact-match base → trained",
                  f"{summary['exact_match_base']:.1%} → {summary['exact_match_trained']:.1%}")
    table.add_row("MLflow run id", summary["mlflow_run_id"])
    console.print(table)
    console.print("Open the UIs: [bold]make ui[/] (Dagster http://127.0.0.1:3000, MLflow http://127.0.0.1:5000)")


def bench(args: argparse.Namespace) -> int:
    if args.which == "loader":
        from bench import loader

        loader.main((["--quick"] if args.quick else []) + (["--no-petastorm"] if args.no_petastorm else []))
        return 0
    from bench import training

    training.main(["--quick"] if args.quick else [])
    return 0


def reproduce(args: argparse.Namespace) -> int:
    # Reads a state folder that recorded the run; creates nothing there (a mistyped --home used to
    # get a dagster/ folder before the refusal).
    from resources.paths import refuse_read_only_state, state_root
    from training_core.errors import ConfigError

    root = state_root(args.home)
    if not root.is_dir():
        reason = "is a file" if root.exists() else "does not exist"
        raise ConfigError(f"state folder {root} is not usable: it {reason}; pass --home (or TESSERA_HOME) of the "
                          "state folder that recorded the run")
    if not args.tracking_uri:  # the reproduction is logged into the folder's mlflow.db: refused before Ray starts
        refuse_read_only_state(root, root, root / "mlflow.db")
    os.environ["TESSERA_HOME"] = str(root)
    from pydantic import ValidationError

    from training_core.errors import TesseraError

    try:
        from pipelines.reproduce import reproduce_run

        return reproduce_run(args.run_id, console, args.tracking_uri)
    except (TesseraError, ValidationError):
        raise  # main prints these as one line, exit 2
    except Exception as error:  # noqa: BLE001 - exit 1 means "metrics differ": a crash must never read as that
        traceback.print_exc()  # unexpected: the traceback is for a bug report; the last line is for the user
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(f"tessera reproduce: could not reproduce run {args.run_id}: {type(error).__name__}"
              f"{': ' + reason if reason else ''}", file=sys.stderr)
        return 2


def free_slots(args: argparse.Namespace) -> int:
    """For runs launched with Dagster's own CLI (no tessera process watches them): fail the runs whose
    process was killed, which frees their training pool slots for the runs waiting behind them."""
    from resources.paths import state_root
    from training_core.errors import ConfigError

    root = state_root(args.home)
    if not (root / "dagster").is_dir():
        raise ConfigError(f"state folder {root} has no Dagster instance (no {root / 'dagster'}); pass --home")
    prepare_home(str(root))
    instance = load_instance()
    freed, released = free_training_pool(instance)
    _say_freed(freed, released)
    console.print(f"{len(freed)} abandoned run(s) in {root}; {len(released)} ended run(s) still holding a slot")
    return 0


def _say_freed(failed: list[str], released: list[str]) -> None:
    for run_id in failed:
        console.print(f"run {run_id} was abandoned by a killed process: marked failed, its pool slot freed")
    for run_id in released:
        console.print(f"run {run_id} had ended but still held its training pool slot (or place in its queue): freed")


def demo_run_tags() -> dict[str, str]:
    from pipelines.jobs import DEMO_RUN_TAG

    return {LAUNCHER_TAG: this_process(), DEMO_RUN_TAG: "true"}


def _not_shown_by_dagster(record: logging.LogRecord) -> bool:
    return not hasattr(record, "dagster_meta")  # set by Dagster's handler of its managed python loggers


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:  # a step's lines the instance's dagster.yaml hands to Dagster's
        handler.addFilter(_not_shown_by_dagster)  # log are printed by Dagster's console logger: not twice
    parser = argparse.ArgumentParser(prog="tessera", description="Reproducible LLM fine-tuning pipeline")
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="materialize the whole asset graph on embedded defaults")
    p_demo.add_argument("--home", help="state directory (default $TESSERA_HOME or .tessera/)")
    p_demo.add_argument("--json", help="also write the summary as JSON to this file")
    p_demo.set_defaults(handler=demo)
    p_repro = sub.add_parser(
        "reproduce", help="rerun a training run from its MLflow lineage",
        description="Rebuild a training run's inputs from its MLflow lineage, verify their digests, train again "
                    "with the recorded config and seeds, and print recorded vs reproduced metrics. Exit status: "
                    "0 all metrics equal, 1 some differ, 2 cannot reproduce (the reason is printed). Trains on "
                    "$TESSERA_RAY_ADDRESS when set, else on in-process Ray. Reads the run from --tracking-uri, else "
                    "the state folder's mlflow.db.")
    p_repro.add_argument("run_id", help="MLflow run id of the training run (the lora_adapter asset's mlflow_run)")
    p_repro.add_argument("--home", help="state directory that recorded the run (default $TESSERA_HOME or .tessera/)")
    p_repro.add_argument("--tracking-uri", help="MLflow tracking URI that recorded the run, e.g. a tracking server "
                         "(on Kubernetes: --tracking-uri \"$MLFLOW_TRACKING_URI\"; default sqlite:///<home>/mlflow.db)")
    p_repro.set_defaults(handler=reproduce)
    p_free = sub.add_parser(
        "free-slots", help="fail runs whose process was killed, freeing their training pool slots",
        description="A run killed while training holds the training pool's slot until something marks it failed: "
                    "dagster dev's run monitoring, the next tessera demo, or this command (for runs started with "
                    "Dagster's own CLI). Only runs whose launching process is certainly gone on this host are touched. "
                    "Slots that runs which have ended still hold (a killed run the code server failed) are freed.")
    p_free.add_argument("--home", help="state directory (default $TESSERA_HOME or .tessera/)")
    p_free.set_defaults(handler=free_slots)
    p_bench = sub.add_parser("bench", help="run a benchmark; writes bench/results/loader.json or training.json, and .png")
    p_bench.add_argument("which", choices=["loader", "train"])
    p_bench.add_argument("--quick", action="store_true",
                         help="smaller sizes, for a smoke run; results go to bench/results/quick/ (git-ignored)")
    p_bench.add_argument("--no-petastorm", action="store_true",
                         help="loader: skip the Petastorm baseline (its own venv is built on first use)")
    p_bench.set_defaults(handler=bench)
    args = parser.parse_args(argv)
    from pydantic import ValidationError

    from training_core.errors import TesseraError

    try:
        return args.handler(args)
    except TesseraError as error:  # bad input we refused on purpose: the message says what to fix
        print(f"tessera {args.command}: {error}", file=sys.stderr)
        return 2
    except ValidationError as error:  # a setting from the environment that a resource refused
        problems = "; ".join(f"{error.title}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        print(f"tessera {args.command}: {problems}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
