"""Where the 1-worker overhead over a plain step comes from: the same step in alternating fresh processes.

Each round starts one fresh Python process per variant, in turns, so that a slow minute of the
shared machine hits all of them alike. Every variant trains the training benchmark's model and
LoRA (``bench.training``: micro batch 4, seq 64, AdamW, one thread pinned to core 0) for 20 + 300
steps and reports wall and step-thread CPU ms per step. Every step is the training loop's
(training_core/train/loop.py): batches as ``EpochBatches.next()`` gives them (packed rows, each
example with its own position ids), the attention inputs that keep examples apart built as each
micro-batch goes to the model (``EpochBatches.model_inputs``), and the loss over the step's trained
tokens (``num_items_in_batch``, from ``step_token_count``):

- ``plain``: PyTorch + PEFT, no DeepSpeed;
- ``deepspeed``: the same step through ``deepspeed.initialize`` with Tessera's ZeRO-2 config, one rank,
  ``engine.backward(..., scale_wrt_gas=False)`` as the loop calls it;
- ``deepspeed_reader``: as ``deepspeed``, each batch read from the row-group reader by ``EpochBatches``
  (warm cache, one decode thread) as the step needs it, instead of read before the timed steps;
- ``deepspeed_ray_actor``: as ``deepspeed``, run inside a Ray actor (``num_cpus=1``) of a local Ray.

    .venv/bin/python -m bench.step_overhead_ab [--rounds 3] [--what plain deepspeed ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("plain", "deepspeed", "deepspeed_reader", "deepspeed_ray_actor")
WARMUP_STEPS, MEASURED_STEPS = 20, 300


def measure(variant: str) -> dict:
    """One variant in this process (the Ray actor variant runs the DeepSpeed one in an actor)."""
    if variant == "deepspeed_ray_actor":
        import ray

        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="error")
        try:
            return ray.get(ray.remote(num_cpus=1)(_InActor).remote().run.remote())
        finally:
            ray.shutdown()
    return _step_loop(variant)


class _InActor:
    def run(self) -> dict:
        return _step_loop("deepspeed")


def _step_loop(variant: str) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", DS_ACCELERATOR="cpu")
    os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[0]])
    from types import SimpleNamespace

    import torch

    from bench.training import DATA_ROOT, LORA_R, MICRO_BATCH, prepare_inputs, warm_row_group_cache
    from training_core.train.batches import EpochBatches
    from training_core.train.config import TrainingConfig
    from training_core.train.loss_weighting import loss_to_backpropagate, step_token_count
    from training_core.train.model_setup import apply_method, load_base_model

    torch.set_num_threads(1)
    inputs = prepare_inputs(DATA_ROOT)
    warm_row_group_cache(inputs)
    config = TrainingConfig(num_workers=1, zero_stage=2, micro_batch_size=MICRO_BATCH, max_steps=10**6,
                            lora={"r": LORA_R})
    torch.manual_seed(config.seed)
    model = apply_method(load_base_model(config, inputs.model_dir), config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
    batches = EpochBatches(SimpleNamespace(train_dirs=[inputs.train_dir], cache_dir=inputs.cache_dir,
                                           cache_size_limit_bytes=None, cache_policy="evict"),
                           config, rank=0, world_size=1, epoch=0, state=None)
    if variant == "deepspeed_reader":
        next_batch = batches.next
    else:  # read before the timed steps; each one's attention inputs are still built in its step
        next_batch = iter([batches.next() for _ in range(WARMUP_STEPS + MEASURED_STEPS)]).__next__

    if variant == "plain":
        def step(batch: dict) -> None:
            step_tokens = step_token_count([batch], world_size=1, device="cpu")
            model(**batches.model_inputs(batch, "cpu"), num_items_in_batch=step_tokens).loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], config.gradient_clipping)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    else:
        import torch.distributed as dist

        from training_core.train.deepspeed_config import build_deepspeed_config
        from training_core.train.deepspeed_startup import import_deepspeed, skip_unused_deepspeed_startup

        deepspeed = import_deepspeed()
        skip_unused_deepspeed_startup(False)
        dist.init_process_group("gloo", rank=0, world_size=1)
        deepspeed.init_distributed(dist_backend="gloo")
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, dist_init_required=False,
                                               config=build_deepspeed_config(config, 1))

        def step(batch: dict) -> None:  # gradient_accumulation_steps is 1: one micro-batch a step
            step_tokens = step_token_count([batch], world_size=1, device=engine.device)
            loss = engine(**batches.model_inputs(batch, engine.device), num_items_in_batch=step_tokens).loss
            engine.backward(loss_to_backpropagate(loss, world_size=1), scale_wrt_gas=False)
            engine.step()

    for _ in range(WARMUP_STEPS):
        step(next_batch())
    started, cpu_started = time.perf_counter(), time.thread_time()
    for _ in range(MEASURED_STEPS):
        step(next_batch())
    wall, cpu = time.perf_counter() - started, time.thread_time() - cpu_started
    batches.close()
    return {"ms_per_step": 1e3 * wall / MEASURED_STEPS, "cpu_ms_per_step": 1e3 * cpu / MEASURED_STEPS}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--what", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--measure", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in this process
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    runs: dict[str, list[dict]] = {variant: [] for variant in args.what}
    for index in range(args.rounds):
        for variant in args.what:
            done = subprocess.run([sys.executable, "-m", "bench.step_overhead_ab", "--measure", variant],
                                  capture_output=True, text=True, env=env, timeout=900)
            if done.returncode != 0:
                raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            runs[variant].append(result)
            print(f"round {index + 1} {variant}: {result['ms_per_step']:.2f} ms/step "
                  f"(step thread CPU {result['cpu_ms_per_step']:.2f})", flush=True)
    summary = {variant: {"median_ms_per_step": statistics.median(r["ms_per_step"] for r in results),
                         "runs": results} for variant, results in runs.items()}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
