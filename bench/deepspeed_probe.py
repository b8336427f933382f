"""DeepSpeed steps between plain processes, without Ray: what the 2-worker scaling is bounded by.

The training benchmark's ``scaling_2_vs_1`` is measured through Ray Train. This probe runs the same
model, LoRA, optimizer and DeepSpeed config (``build_deepspeed_config``) in 1 or 2 processes that
are started directly (gloo over TCP, each pinned to its own core, one thread), on fixed random
batches, and times every ``torch.distributed`` collective DeepSpeed issues inside the measured
steps. It separates what DeepSpeed's communication pattern costs on this machine from what Ray
adds, and compares ZeRO-2 with ZeRO-0 (plain data-parallel all-reduce).

``python -m bench.deepspeed_probe --rank R --world W --stage S …`` is one such process; the
benchmark calls :func:`deepspeed_scaling_probe`.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import time

from bench.machine_probes import run_rank_processes

# What DeepSpeed 0.19 calls through deepspeed.comm's torch backend.
COLLECTIVES = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "barrier")


def _count_collectives(dist, enabled: list[bool]) -> dict[str, list[float]]:
    """Wrap the collectives so each call's wall time (until it completes) is added while
    ``enabled[0]``; returns name -> [calls, seconds]."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def timed(*args, _original=original, _name=name, **kwargs):
            started = time.perf_counter()
            work = _original(*args, **kwargs)
            if kwargs.get("async_op") and work is not None:
                work.wait()  # count the whole collective, not just its launch
            if enabled[0]:
                totals[_name][0] += 1
                totals[_name][1] += time.perf_counter() - started
            return work

        setattr(dist, name, timed)
    return totals


def measure(rank: int, world: int, stage: int, port: int, model_dir: str, warmup: int, steps: int,
            micro_batch: int, seq_len: int, lora_r: int) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    from training_core.train.loop import pin_to_own_cores

    pin_to_own_cores(rank, world, cpus_per_worker=1)  # as each Ray worker pins itself
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    enabled = [False]
    totals = _count_collectives(dist, enabled)

    from training_core.train.config import TrainingConfig
    from training_core.train.deepspeed_config import build_deepspeed_config
    from training_core.train.deepspeed_startup import import_deepspeed, skip_unused_deepspeed_startup
    from training_core.train.model_setup import apply_method, load_base_model

    deepspeed = import_deepspeed()
    skip_unused_deepspeed_startup(False)
    deepspeed.init_distributed(dist_backend="gloo")
    config = TrainingConfig(num_workers=world, zero_stage=stage, micro_batch_size=micro_batch,
                            max_steps=warmup + steps, lora={"r": lora_r})
    torch.manual_seed(config.seed)
    model = apply_method(load_base_model(config, model_dir), config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, dist_init_required=False,
                                           config=build_deepspeed_config(config, world))
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randint(4, vocab, (micro_batch, seq_len), generator=generator) for _ in range(8)]
    for index in range(warmup + steps):
        if index == warmup:
            enabled[0] = True
            started, cpu_started = time.perf_counter(), time.thread_time()
        batch = batches[index % len(batches)]
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
    wall, cpu = time.perf_counter() - started, time.thread_time() - cpu_started
    enabled[0] = False
    dist.barrier()
    dist.destroy_process_group()
    return {"s_per_step": wall / steps, "cpu_s_per_step": cpu / steps,
            "collectives_per_step": {name: {"calls": calls / steps, "s": seconds / steps}
                                     for name, (calls, seconds) in sorted(totals.items())}}


def run_processes(world: int, stage: int, model_dir: str, warmup: int, steps: int, micro_batch: int,
                  seq_len: int, lora_r: int) -> list[dict]:
    port = 29100 + (os.getpid() + 7 * world + stage) % 800
    arguments = ["bench.deepspeed_probe", f"--world={world}", f"--stage={stage}", f"--port={port}",
                 f"--model={model_dir}", f"--warmup={warmup}", f"--steps={steps}", f"--micro-batch={micro_batch}",
                 f"--seq-len={seq_len}", f"--lora-r={lora_r}"]
    return run_rank_processes(arguments, world, f"DeepSpeed probe (world {world}, ZeRO-{stage})")


def deepspeed_scaling_probe(model_dir: str, micro_batch: int, seq_len: int, lora_r: int, warmup: int = 10,
                            steps: int = 60) -> dict:
    """1 process ZeRO-2, then 2 processes with ZeRO-2 and with ZeRO-0; scaling = samples/s of 2
    processes over 1, taking the slower rank's s/step (the ranks run in lockstep)."""
    runs = {"1_process_zero2": run_processes(1, 2, model_dir, warmup, steps, micro_batch, seq_len, lora_r),
            "2_processes_zero2": run_processes(2, 2, model_dir, warmup, steps, micro_batch, seq_len, lora_r),
            "2_processes_zero0": run_processes(2, 0, model_dir, warmup, steps, micro_batch, seq_len, lora_r)}
    one = runs["1_process_zero2"][0]["s_per_step"]
    result: dict = {"warmup_steps": warmup, "measured_steps": steps, "runs": runs}
    for stage in (2, 0):
        slowest = max(rank["s_per_step"] for rank in runs[f"2_processes_zero{stage}"])
        result[f"scaling_2_vs_1_zero{stage}"] = 2 * one / slowest
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("rank", 0), ("world", 1), ("stage", 2), ("port", 29500), ("warmup", 10),
                          ("steps", 60), ("micro-batch", 4), ("seq-len", 64), ("lora-r", 16)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--model", required=True, help="directory of a saved causal LM")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.rank, args.world, args.stage, args.port, args.model, args.warmup, args.steps,
                             args.micro_batch, args.seq_len, args.lora_r)))


if __name__ == "__main__":
    main()
