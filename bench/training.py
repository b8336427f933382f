"""Training benchmark: Tessera's Ray Train + DeepSpeed path against a plain PyTorch + PEFT loop.

``python -m bench.training [--quick]`` (or ``make bench-train`` = ``tessera bench train``) writes
bench/results/training.json and training.png. Every configuration trains the same tiny Llama
(2 layers, hidden 128, vocab 512, seq 64, micro batch 4, LoRA r=16 on all linear layers) on the
same packed Parquet dataset:

- ``plain``: one process, PyTorch + PEFT, AdamW, one thread; no Ray, no DeepSpeed.
- ``tessera_1w_zero2`` / ``tessera_2w_zero2`` / ``tessera_2w_zero3_offload``: the real path,
  ``training_core.train.launcher.run_training`` on Ray Train with DeepSpeed, 1 CPU per worker.

Seconds per step come from the worker's own loop timing (the run's ``telemetry``). That timer
covers the whole loop, warm-up included, so each Tessera configuration runs twice — ``warmup``
steps and ``warmup + measured`` steps — and s/step is the difference of the two loop times over
``measured`` steps. Start-up is the wall time of ``run_training`` minus the loop time of the same
run: Ray Train worker group start, imports, model load, ``deepspeed.initialize``, and at the end
the final checkpoint/report and worker shutdown. Inputs live in the git-ignored bench/.data/.

The machine is noisy and shared (its speed drifts by ±10–30 % between minutes), so the whole set
runs in alternating rounds (3; 1 with ``--quick``): each round runs ``plain``, two plain loops at
once in separate processes (``ceiling_2_processes``: the most any 2-worker run could get at that
moment) and every Tessera configuration, one after another. Ratios (overhead, scaling, ceiling)
are taken within a round, between runs a minute apart, and the median round is reported; every
round's figures are in ``rounds``. Next to them, a
busy-loop probe of the CPU share two processes get (``machine.cpu_share_*``); those probes and
the gloo latency probe live in :mod:`bench.machine_probes`. :mod:`bench.deepspeed_probe` runs the
same DeepSpeed step in 1 and 2 processes started without Ray and times each collective
(``machine.deepspeed_without_ray``): what the scaling is bounded by before Ray adds anything.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.deepspeed_probe import deepspeed_scaling_probe
from bench.machine_probes import cpu_share_probe, gloo_latency_probe, machine_info
from bench.training_inputs import (  # LORA_R, MICRO_BATCH, prepare_inputs are also read by the A/B scripts
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    LAYERS,
    LORA_R,
    MICRO_BATCH,
    SEQ_LEN,
    VOCAB,
    BenchInputs,
    prepare_inputs,
    warm_row_group_cache,
)
from training_core.train.telemetry import STEP_PHASES

logger = logging.getLogger("bench.training")

BENCH_DIR = Path(__file__).resolve().parent
DATA_ROOT = BENCH_DIR / ".data" / "training"

@dataclass(frozen=True)
class Sizes:
    warmup_steps: int
    measured_steps: int


FULL, QUICK = Sizes(warmup_steps=5, measured_steps=60), Sizes(warmup_steps=2, measured_steps=12)
ROUNDS, QUICK_ROUNDS = 3, 1

# name → (TrainingConfig overrides). Every worker gets one CPU.
TESSERA_CONFIGS: dict[str, dict[str, Any]] = {
    "tessera_1w_zero2": {"num_workers": 1, "zero_stage": 2},
    "tessera_2w_zero2": {"num_workers": 2, "zero_stage": 2},
    "tessera_2w_zero3_offload": {"num_workers": 2, "zero_stage": 3, "offload_optimizer": "cpu"},
}


def training_config(max_steps: int, **overrides: Any):
    from training_core.train.config import TrainingConfig

    return TrainingConfig(
        micro_batch_size=MICRO_BATCH,
        max_steps=max_steps,
        cpus_per_worker=1,
        lora={"r": LORA_R},
        checkpoint_every_steps=10**6,  # only the final checkpoint: a mid-run one would land in the loop time
        **overrides,
    )


# -- plain PyTorch + PEFT ---------------------------------------------------------------------------
def run_plain(inputs: BenchInputs, sizes: Sizes) -> dict:
    """Single process, one thread: the same model, LoRA, batches, AdamW, schedule and clipping."""
    import torch

    from training_core.data import RowGroupReader
    from training_core.data.batch_columns import TRAINING_COLUMNS
    from training_core.train.model_setup import apply_method, load_base_model, model_dtype
    from training_core.train.packed_attention import attention_inputs, packed_rows
    from training_core.train.schedule import build_lr_scheduler

    steps = sizes.warmup_steps + sizes.measured_steps
    config = training_config(steps, num_workers=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # The batches rank 0 of a one-worker Tessera run sees, decoded before timing starts.
        reader = RowGroupReader(inputs.train_dir, columns=TRAINING_COLUMNS, batch_size=MICRO_BATCH,
                                seed=config.data_seed, epoch=0, shuffle=True,
                                shuffle_buffer_row_groups=config.shuffle_buffer_row_groups, workers=1,
                                drop_last=True)
        batches = []
        for batch in reader:
            batches.append(packed_rows(batch["input_ids"], batch["labels"]))  # as EpochBatches gives them
            if len(batches) == steps:
                break
        reader.close()
        torch.manual_seed(config.seed)
        model = apply_method(load_base_model(config, inputs.model_dir), config)
        model.train()
        parameters = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(parameters, lr=config.learning_rate, weight_decay=config.weight_decay)
        scheduler = build_lr_scheduler(optimizer, config)
        step_times, step_cpu, losses = [], [], []
        for batch in batches:
            started, cpu_started = time.perf_counter(), time.thread_time()
            # the mask is built in the step, as Tessera's loop builds it (one micro batch: the token mean)
            loss = model(**batch, **attention_inputs(batch["position_ids"], config.attention, model_dtype(config))).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, config.gradient_clipping)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            step_times.append(time.perf_counter() - started)
            step_cpu.append(time.thread_time() - cpu_started)
    finally:
        torch.set_num_threads(threads)
    measured = step_times[sizes.warmup_steps:]
    return {
        "s_per_step": float(np.mean(measured)),
        "s_per_step_median": float(np.median(measured)),
        "cpu_s_per_step": float(np.mean(step_cpu[sizes.warmup_steps:])),
        "warmup_s": float(sum(step_times[: sizes.warmup_steps])),
        "loss_history": list(enumerate(losses, start=1)),
    }


# -- Tessera ----------------------------------------------------------------------------------------
def shm_op_mtime() -> float | None:
    """mtime of DeepSpeed's JIT-built CPU shared-memory comm op: a change across a run means some
    process rebuilt it meanwhile (20-45 s on this machine, paid by whoever loads it next)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    built = sorted(root.glob("*/deepspeed_shm_comm/deepspeed_shm_comm.so"))
    return max((path.stat().st_mtime for path in built), default=None)


def run_tessera_once(inputs: BenchInputs, name: str, max_steps: int, storage: Path, output: Path) -> dict:
    from training_core.train.launcher import run_training

    config = training_config(max_steps, **TESSERA_CONFIGS[name])
    run_name = f"{name}-{max_steps}-{time.strftime('%H%M%S')}-{os.getpid()}"
    shm_before, started = shm_op_mtime(), time.perf_counter()
    result = run_training(config, model_path=inputs.model_dir, seq_len=SEQ_LEN, cache_dir=inputs.cache_dir,
                          storage_path=storage, run_name=run_name, output_dir=output, max_failures=0,
                          train_dirs=[inputs.train_dir])
    wall = time.perf_counter() - started
    if result.steps != max_steps or result.restarts:
        raise RuntimeError(f"{name}: ran {result.steps}/{max_steps} steps with {result.restarts} restarts")
    telemetry = result.telemetry
    return {"wall_s": wall, "loop_s": telemetry["elapsed_s"], "startup_s": wall - telemetry["elapsed_s"],
            "shm_op_rebuilt": shm_op_mtime() != shm_before, "telemetry": telemetry,
            "loss_history": result.loss_history}


def run_tessera(inputs: BenchInputs, name: str, sizes: Sizes, storage: Path, output: Path) -> dict:
    """Two runs, `warmup` and `warmup + measured` steps; the difference of their loop times is warm."""
    short = run_tessera_once(inputs, name, sizes.warmup_steps, storage, output)
    long = run_tessera_once(inputs, name, sizes.warmup_steps + sizes.measured_steps, storage, output)
    n = sizes.measured_steps

    def per_step(key: str) -> float:  # the measured steps' share of a whole-loop telemetry total
        return (long["telemetry"].get(key, 0.0) - short["telemetry"].get(key, 0.0)) / n

    s_per_step = (long["loop_s"] - short["loop_s"]) / n
    phases = {phase: per_step(f"{phase}_s") for phase in STEP_PHASES}
    phases["other"] = s_per_step - sum(phases.values())  # bookkeeping
    # Wall minus the step thread's CPU time: where it blocked (collectives, in backward/optimizer).
    blocked_all = {phase: per_step(f"{phase}_blocked_s") for phase in STEP_PHASES}
    blocked = {phase: blocked_all[phase] for phase in ("forward", "backward", "optimizer")}
    # The step thread's CPU time per step: unlike wall time, not inflated when other processes or
    # the VM's host take the core, so it compares code paths when the machine is noisy.
    cpu_s_per_step = s_per_step - sum(blocked_all.values())
    startup_split = {key.removeprefix("startup_").removesuffix("_s"): value
                     for key, value in long["telemetry"].items() if key.startswith("startup_")}
    startup_split["final_checkpoint_and_teardown"] = long["startup_s"] - sum(startup_split.values())
    workers = TESSERA_CONFIGS[name]["num_workers"]
    return {
        "s_per_step": s_per_step,
        "s_per_step_including_warmup": long["loop_s"] / (sizes.warmup_steps + n),
        "cpu_s_per_step": cpu_s_per_step,
        "samples_per_s": MICRO_BATCH * workers / s_per_step,
        "phases_s_per_step": phases,
        "blocked_s_per_step": blocked,
        "startup_s": long["startup_s"],
        "startup_split_s": startup_split,
        "startup_s_short_run": short["startup_s"],
        "shm_op_rebuilt": {"short": short["shm_op_rebuilt"], "long": long["shm_op_rebuilt"]},
        "wall_s": {"short": short["wall_s"], "long": long["wall_s"]},
        "loop_s": {"short": short["loop_s"], "long": long["loop_s"]},
        "loss_history": long["loss_history"],
        "telemetry": long["telemetry"],
    }


def _median_round(rounds: list[dict[str, dict]], name: str) -> dict:
    """`name`'s run from the round with its median s/step (the upper one of an even count)."""
    ordered = sorted(rounds, key=lambda r: r[name]["s_per_step"])
    return ordered[len(ordered) // 2][name]


# -- report -----------------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(name: str) -> str:
        return name.replace("tessera_", "").replace("_", "\n")

    names = list(result["s_per_step"])
    colors = ["#777777" if n == "plain" else "#1f77b4" for n in names]
    rate_names = names + ["2 plain\nprocesses"]
    rates = [result["samples_per_s"][n] for n in names] + [result["ceiling_2_processes"]["samples_per_s"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    panels = [
        ("ms per optimizer step (lower is better)", [1e3 * result["s_per_step"][n] for n in names],
         [label(n) for n in names], colors),
        ("samples/s, all workers (higher is better)", rates, [label(n) for n in rate_names],
         colors + ["#bbbbbb"]),
        ("start-up + teardown, s (lower is better)", list(result["startup_s"].values()),
         [label(n) for n in result["startup_s"]], ["#1f77b4"] * len(result["startup_s"])),
    ]
    for axis, (title, values, labels, color) in zip(axes, panels):
        bars = axis.bar(range(len(values)), values, color=color)
        axis.set_xticks(range(len(values)), labels, fontsize=8)
        axis.set_title(title, fontsize=10)
        axis.bar_label(bars, fmt="%.1f", fontsize=8)
    axes[2].axhline(10, color="red", linestyle="--", linewidth=1, label="target 10 s")
    axes[2].legend(fontsize=8)

    def fmt(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}×"

    fig.suptitle(f"Tiny Llama, LoRA r={LORA_R}, seq {SEQ_LEN}, micro batch {MICRO_BATCH}, 1 CPU per worker: "
                 f"overhead 1w/plain {fmt(result['overhead_ratio_1_worker'])} (target ≤1.15), "
                 f"scaling 2w/1w {fmt(result['scaling_2_vs_1'])} (target ≥1.8; this machine's 2-process "
                 f"ceiling {fmt(result['ceiling_2_processes']['scaling_vs_plain'])})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_plain_subprocesses(sizes: Sizes, count: int = 2) -> list[dict]:
    """`count` plain loops at once, each in its own process, no communication: the most this machine
    gives `count` single-threaded trainers (the ceiling for Tessera's data-parallel scaling)."""
    command = [sys.executable, "-m", "bench.training", "--measure-plain",
               f"--warmup-steps={sizes.warmup_steps}", f"--measured-steps={sizes.measured_steps}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    processes = [subprocess.Popen(command, cwd=BENCH_DIR.parent, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True) for _ in range(count)]
    results = []
    for process in processes:
        out, _ = process.communicate(timeout=900)
        if process.returncode != 0:
            raise RuntimeError(f"plain subprocess failed with status {process.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def run(output_dir: Path, quick: bool = False) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    sizes = QUICK if quick else FULL
    output_dir.mkdir(parents=True, exist_ok=True)
    inputs = prepare_inputs(DATA_ROOT)
    warm_row_group_cache(inputs)
    storage, trained = DATA_ROOT / "ray", DATA_ROOT / "trained"
    shutil.rmtree(storage, ignore_errors=True)
    machine = machine_info()
    machine["cpu_share_2_busy_processes_at_start"] = cpu_share_probe()
    errors: dict[str, str] = {}
    from training_core.train.ray_trainer import use_local_ray_defaults

    use_local_ray_defaults()  # in-process local Ray, as the local code location runs it
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, logging_level="warning")
    rounds: list[dict[str, dict]] = []
    try:
        for index in range(QUICK_ROUNDS if quick else ROUNDS):
            logger.info("round %d: plain PyTorch + PEFT, %d + %d steps", index + 1, sizes.warmup_steps,
                        sizes.measured_steps)
            this_round: dict[str, dict] = {"plain": run_plain(inputs, sizes)}
            logger.info("round %d: two plain loops at once (the machine's 2-process ceiling)", index + 1)
            this_round["plain_2_processes"] = {"runs": run_plain_subprocesses(sizes)}
            for name in TESSERA_CONFIGS:
                if name in errors:
                    continue
                logger.info("round %d: %s, %d and %d steps", index + 1, name, sizes.warmup_steps,
                            sizes.warmup_steps + sizes.measured_steps)
                try:
                    this_round[name] = run_tessera(inputs, name, sizes, storage, trained)
                except Exception as error:  # one broken configuration must not hide the others' numbers
                    logger.exception("%s failed", name)
                    errors[name] = f"{type(error).__name__}: {error}"[:2000]
            rounds.append(this_round)
    finally:
        ray.shutdown()
    machine["cpu_share_2_busy_processes_at_end"] = cpu_share_probe()
    measured = [name for name in TESSERA_CONFIGS if all(name in r for r in rounds)]
    details = {name: _median_round(rounds, name) for name in ["plain", *measured]}
    trainable = details.get("tessera_1w_zero2", {}).get("telemetry", {}).get("trainable_parameters")
    machine["gloo_2_processes"] = gloo_latency_probe(int(trainable or 69632))
    try:  # the same DeepSpeed step in processes started without Ray (bench/deepspeed_probe.py)
        machine["deepspeed_without_ray"] = deepspeed_scaling_probe(inputs.model_dir, MICRO_BATCH, SEQ_LEN, LORA_R)
    except Exception as error:  # a diagnostic: its failure must not lose the measured runs
        logger.exception("DeepSpeed probe without Ray failed")
        errors["deepspeed_without_ray"] = f"{type(error).__name__}: {error}"[:2000]
    machine["load_average_1m_at_end"] = os.getloadavg()[0]

    def median_of(values: list[float] | None) -> float | None:
        return float(np.median(values)) if values else None

    def per_round(name: str, key: str) -> list[float]:
        return [r[name][key] for r in rounds]

    workers = {"plain": 1, **{n: TESSERA_CONFIGS[n]["num_workers"] for n in TESSERA_CONFIGS}}

    def samples(r: dict, name: str) -> float:  # samples/s of `name` in round `r`, all workers
        return MICRO_BATCH * workers[name] / r[name]["s_per_step"]

    def ratios(a: str, b: str, value) -> list[float] | None:
        """value(round, a) / value(round, b) within each round; None when either was not measured."""
        if not {a, b} <= {"plain", *measured}:
            return None
        return [value(r, a) / value(r, b) for r in rounds]

    s_per_step = {n: median_of(per_round(n, "s_per_step")) for n in ["plain", *measured]}
    samples_per_s = {n: MICRO_BATCH * workers[n] / s for n, s in s_per_step.items()}
    cpu_s_per_step = {n: median_of(per_round(n, "cpu_s_per_step")) for n in ["plain", *measured]}
    ceilings = [sum(MICRO_BATCH / run_["s_per_step"] for run_ in r["plain_2_processes"]["runs"]) for r in rounds]
    ceiling_scaling = [c / samples(r, "plain") for c, r in zip(ceilings, rounds)]
    overhead = ratios("tessera_1w_zero2", "plain", lambda r, n: r[n]["s_per_step"])
    overhead_cpu = ratios("tessera_1w_zero2", "plain", lambda r, n: r[n]["cpu_s_per_step"])
    scaling = ratios("tessera_2w_zero2", "tessera_1w_zero2", samples)

    result = {
        "s_per_step": s_per_step,
        "cpu_s_per_step": cpu_s_per_step,
        "samples_per_s": samples_per_s,
        "overhead_ratio_1_worker": median_of(overhead),
        # diagnostic, not the target: the same ratio in the step thread's CPU time (see run_tessera)
        "overhead_ratio_1_worker_cpu": median_of(overhead_cpu),
        "scaling_2_vs_1": median_of(scaling),
        "startup_s": {n: median_of(per_round(n, "startup_s")) for n in measured},
        "targets": {"overhead_ratio_1_worker_max": 1.15, "scaling_2_vs_1_min": 1.8, "startup_s_max": 10.0},
        "ceiling_2_processes": {
            "samples_per_s": median_of(ceilings),
            "scaling_vs_plain": median_of(ceiling_scaling),
            "s_per_step": [run_["s_per_step"] for r in rounds for run_ in r["plain_2_processes"]["runs"]],
        },
        "rounds": {
            "s_per_step": {n: per_round(n, "s_per_step") for n in ["plain", *measured]},
            "startup_s": {n: per_round(n, "startup_s") for n in measured},
            "overhead_ratio_1_worker": overhead, "overhead_ratio_1_worker_cpu": overhead_cpu,
            "scaling_2_vs_1": scaling, "ceiling_scaling_vs_plain": ceiling_scaling,
        },
        "plain_s_per_step_runs": per_round("plain", "s_per_step"),
        "phases_s_per_step": {n: details[n]["phases_s_per_step"] for n in measured},
        "blocked_s_per_step": {n: details[n]["blocked_s_per_step"] for n in measured},
        "startup_split_s": {n: details[n]["startup_split_s"] for n in measured},
        "errors": errors,
        "setup": {"layers": LAYERS, "hidden": HIDDEN, "intermediate": INTERMEDIATE, "heads": HEADS, "vocab": VOCAB,
                  "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH, "lora_r": LORA_R,
                  "warmup_steps": sizes.warmup_steps, "measured_steps": sizes.measured_steps,
                  "cpus_per_worker": 1, "ray_num_cpus": 2, "train_rows": inputs.train_rows, "quick": quick,
                  "ray_train_preemption_watcher": os.environ.get("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"),
                  "rounds": len(rounds),
                  "method": "Tessera s/step = (loop_s(warmup+measured) - loop_s(warmup)) / measured from the "
                            "workers' telemetry (it has no per-step times); start-up = run_training wall - "
                            "loop_s of the longer run; every figure is the median over alternating rounds "
                            "(plain, 2 plain processes, each Tessera configuration), ratios taken within a "
                            "round; details = each configuration's median round"},
        "machine": machine,
        "details": {n: {k: v for k, v in d.items() if k != "loss_history"} for n, d in details.items()},
    }
    if "tessera_1w_zero2" in measured:
        def losses(run_: dict) -> list[float]:
            return [loss for _, loss in run_["loss_history"]]

        # Same init, batches, schedule and clipping: the curves agree, so both loops do the same work.
        result["max_abs_loss_diff_plain_vs_1w"] = max(
            float(np.max(np.abs(np.subtract(losses(r["plain"]), losses(r["tessera_1w_zero2"]))))) for r in rounds)
    (output_dir / "training.json").write_text(json.dumps(result, indent=2, default=float))
    plot(result, output_dir / "training.png")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK.warmup_steps} + {QUICK.measured_steps} steps instead of "
                             f"{FULL.warmup_steps} + {FULL.measured_steps} (smoke test)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="default bench/results, or bench/results/quick (git-ignored) with --quick, so that a "
                             "smoke run never replaces the recorded results")
    parser.add_argument("--measure-plain", action="store_true", help=argparse.SUPPRESS)  # child of the ceiling run
    parser.add_argument("--warmup-steps", type=int, default=FULL.warmup_steps, help=argparse.SUPPRESS)
    parser.add_argument("--measured-steps", type=int, default=FULL.measured_steps, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_plain:
        measured = run_plain(prepare_inputs(DATA_ROOT), Sizes(args.warmup_steps, args.measured_steps))
        print(json.dumps({k: v for k, v in measured.items() if k != "loss_history"}))
        return
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    output_dir = args.output_dir or BENCH_DIR / "results" / ("quick" if args.quick else "")
    result = run(output_dir, quick=args.quick)
    summary = {key: result[key] for key in ("s_per_step", "samples_per_s", "overhead_ratio_1_worker",
                                            "overhead_ratio_1_worker_cpu", "cpu_s_per_step",
                                            "scaling_2_vs_1", "startup_s", "ceiling_2_processes", "errors")}
    print(json.dumps(summary, indent=2, default=float))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
