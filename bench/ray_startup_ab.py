"""A/B of Ray Train start-up on local Ray: pooled worker processes on or off, in alternating fresh processes.

Each round starts one fresh Python process per setting (``TESSERA_RAY_TRAIN_POOLED_PROCESSES`` 1 or
0), in turns, so that a slow minute of a shared machine hits both alike. A process starts its own
local Ray (``ray.init(num_cpus=2)`` after ``use_local_ray_defaults``) and times two runs: the first
in a fresh Ray is what a Dagster run does, the second what the training benchmark's ``startup_s``
measures. ``noop`` runs a 2-worker ``TorchTrainer`` whose function does nothing (``fit()`` wall);
``tessera_1w_zero2`` / ``tessera_2w_zero2`` run 5 steps of the training benchmark's configuration
(start-up = ``run_training`` wall - loop time). Prints one line per process and a JSON summary.

    .venv/bin/python -m bench.ray_startup_ab [--rounds 3] [--what noop tessera_1w_zero2 tessera_2w_zero2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SETTINGS = {"pooled": "1", "ray_runtime_envs": "0"}
RUNS_PER_PROCESS = 2


def _noop(config: dict) -> None:
    return None


def _one_process(what: str) -> list[float]:
    """In a fresh process: start local Ray, time RUNS_PER_PROCESS runs of ``what``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import ray

    from training_core.train.ray_trainer import torch_trainer_class, use_local_ray_defaults, use_quick_health_checks

    use_local_ray_defaults()
    use_quick_health_checks()
    ray.init(address="local", num_cpus=2, logging_level="warning")
    seconds = []
    if what == "noop":
        import ray.train
        from ray.train.torch import TorchConfig

        storage = tempfile.mkdtemp(prefix="tessera-ab-")
        for index in range(RUNS_PER_PROCESS):
            began = time.perf_counter()
            torch_trainer_class()(
                _noop, torch_config=TorchConfig(backend="gloo"),
                scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                run_config=ray.train.RunConfig(name=f"noop-{index}", storage_path=storage),
            ).fit()
            seconds.append(time.perf_counter() - began)
    else:
        from bench import training as bench_training

        inputs = bench_training.prepare_inputs(bench_training.DATA_ROOT)
        for _ in range(RUNS_PER_PROCESS):
            run = bench_training.run_tessera_once(inputs, what, 5, bench_training.DATA_ROOT / "ray-ab",
                                                  bench_training.DATA_ROOT / "trained-ab")
            seconds.append(run["startup_s"])
    ray.shutdown()
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--what", nargs="+", default=["noop", "tessera_1w_zero2", "tessera_2w_zero2"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(_one_process(args.child)), flush=True)
        return
    results: dict[str, dict[str, list[list[float]]]] = {w: {s: [] for s in SETTINGS} for w in args.what}
    for round_index in range(args.rounds):
        for what in args.what:
            for setting, value in SETTINGS.items():
                env = {**os.environ, "TESSERA_RAY_TRAIN_POOLED_PROCESSES": value}
                done = subprocess.run([sys.executable, "-m", "bench.ray_startup_ab", "--child", what], env=env,
                                      capture_output=True, text=True, check=True)
                line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
                seconds = json.loads(line.removeprefix("RESULT "))
                results[what][setting].append(seconds)
                print(f"round {round_index} {what} {setting}: " + " / ".join(f"{s:.2f} s" for s in seconds),
                      flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
