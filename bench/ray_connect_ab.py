"""A/B of a Dagster training run's Ray connect: dagster-ray's Ray Data options applied or not.

What a Dagster run's training asset does on local Ray, in alternating fresh processes: build
`LocalRayCluster` as the local definitions do, `connect_to_cluster` (``ray.init``; with
``apply_on_connect`` dagster-ray also applies its Ray Data options in the driver and in one
worker), then one 2-worker ``TorchTrainer`` run whose function does nothing. Prints one line per
process (connect / fit / total seconds) and a JSON summary.

    .venv/bin/python -m bench.ray_connect_ab [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SETTINGS = {"ray_data_options_applied": True, "tessera_default": False}


def _noop(config: dict) -> None:
    return None


def _one_process(apply_on_connect: bool) -> dict[str, float]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import dagster as dg
    import ray
    import ray.train
    from dagster_ray import Lifecycle
    from ray.train.torch import TorchConfig

    from resources.ray_cluster import LocalRayCluster, RayDataOptions, connect_to_cluster
    from training_core.train.ray_trainer import torch_trainer_class, use_quick_health_checks

    use_quick_health_checks()
    cluster = LocalRayCluster(lifecycle=Lifecycle(connect=False), ray_init_options={"logging_level": "warning"},
                              data_execution_options=RayDataOptions(apply_on_connect=apply_on_connect))
    began = time.perf_counter()
    connect_to_cluster(cluster, dg.build_init_resource_context())
    connected = time.perf_counter()
    torch_trainer_class()(
        _noop, torch_config=TorchConfig(backend="gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name="noop", storage_path=tempfile.mkdtemp(prefix="tessera-ab-")),
    ).fit()
    done = time.perf_counter()
    ray.shutdown()
    return {"connect_s": connected - began, "fit_s": done - connected, "total_s": done - began}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=sorted(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(_one_process(SETTINGS[args.child])), flush=True)
        return
    results: dict[str, list[dict[str, float]]] = {setting: [] for setting in SETTINGS}
    for round_index in range(args.rounds):
        for setting in SETTINGS:  # alternating, so a slow minute of a shared machine hits both alike
            done = subprocess.run([sys.executable, "-m", "bench.ray_connect_ab", "--child", setting],
                                  capture_output=True, text=True, check=True)
            line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
            run = json.loads(line.removeprefix("RESULT "))
            results[setting].append(run)
            print(f"round {round_index} {setting}: " + ", ".join(f"{k} {v:.2f}" for k, v in run.items()), flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
