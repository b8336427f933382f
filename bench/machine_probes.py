"""What the machine gives a benchmark at the moment it runs, recorded next to the results.

- ``machine_info``: CPU, load, versions.
- ``cpu_share_probe``: CPU-seconds per wall-second two busy processes get (is the machine shared?).
- ``gloo_latency_probe``: µs per gloo collective between two single-threaded processes, at the
  sizes a ZeRO-2 LoRA step sends (the floor a 2-worker step pays over 1).

``python -m bench.machine_probes --measure-gloo --rank R …`` is the probe's child process.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def machine_info() -> dict:
    import deepspeed
    import peft
    import ray
    import torch
    import transformers

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": model,
        "load_average_1m_at_start": os.getloadavg()[0],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "ray": ray.__version__,
    }


def measure_gloo(rank: int, port: int, elements: int, repeats: int = 500) -> dict:
    """Microseconds per gloo collective between two single-threaded processes on this machine, for
    the sizes a ZeRO-2 LoRA step sends: the gradient all-reduce, the grad-norm all-reduce (1
    element) and the parameter all-gather. Their sum is the floor a 2-worker step pays over 1.

    Beside them, the same bytes exchanged over a plain loopback TCP socket (send ours, receive
    theirs, as a 2-rank all-reduce must): what the machine itself needs for that traffic, so the
    rest of a collective's time is gloo's own work and thread hand-offs."""
    import socket

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    gradient, norm = torch.zeros(elements), torch.zeros(1)
    gathered, shard = torch.zeros(elements), torch.zeros(elements // 2)
    collectives = {
        "all_reduce_gradients": lambda: dist.all_reduce(gradient),
        "all_reduce_norm": lambda: dist.all_reduce(norm),
        "all_gather_parameters": lambda: dist.all_gather_into_tensor(gathered, shard),
    }
    result: dict = {"collectives": {name: _time_us(operation, repeats) for name, operation in collectives.items()}}

    # The TCP baseline: rank 0 listens on port + 1, sends its bytes and waits for rank 1's.
    if rank == 0:
        listener = socket.create_server(("127.0.0.1", port + 1))
        dist.barrier()
        connection = listener.accept()[0]
        listener.close()
    else:
        dist.barrier()
        connection = socket.create_connection(("127.0.0.1", port + 1), timeout=60)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def exchange(payload: bytearray) -> None:
        incoming, received = memoryview(bytearray(len(payload))), 0
        if rank == 0:
            connection.sendall(payload)
        while received < len(payload):
            received += connection.recv_into(incoming[received:])
        if rank == 1:
            connection.sendall(payload)

    gradient_bytes, one_element = bytearray(4 * elements), bytearray(4)
    result["tcp_exchange"] = {"gradients": _time_us(lambda: exchange(gradient_bytes), repeats),
                              "one_element": _time_us(lambda: exchange(one_element), repeats)}
    connection.close()
    dist.barrier()
    dist.destroy_process_group()
    return result


def _time_us(operation, repeats: int) -> float:
    for _ in range(20):
        operation()
    started = time.perf_counter()
    for _ in range(repeats):
        operation()
    return 1e6 * (time.perf_counter() - started) / repeats


def run_rank_processes(arguments: list[str], world: int, what: str, timeout_s: float = 600) -> list[dict]:
    """Run ``python -m <arguments> --rank=R`` for every rank at once (one thread each) and return
    the JSON object each prints on its last line; a failed rank raises with its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    processes = [subprocess.Popen([sys.executable, "-m", *arguments, f"--rank={rank}"], cwd=BENCH_DIR.parent,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(world)]
    outputs = [process.communicate(timeout=timeout_s) for process in processes]
    for process, (_, stderr) in zip(processes, outputs):
        if process.returncode != 0:
            raise RuntimeError(f"{what} failed:\n{stderr[-2000:]}")
    return [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outputs]


def gloo_latency_probe(elements: int) -> dict:
    port = 29000 + os.getpid() % 1000
    arguments = ["bench.machine_probes", "--measure-gloo", f"--gloo-port={port}", f"--gloo-elements={elements}"]
    measured = run_rank_processes(arguments, 2, "gloo latency probe", timeout_s=300)[0]
    return {"elements": elements, "us_per_collective": measured["collectives"],
            "us_per_zero2_step": sum(measured["collectives"].values()),
            "us_per_tcp_exchange": measured["tcp_exchange"]}


def _burn(seconds: float) -> float:
    started, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - started < seconds:
        pass
    return (time.process_time() - cpu) / (time.perf_counter() - started)


def cpu_share_probe(seconds: float = 2.0) -> list[float]:
    """CPU-seconds per wall-second each of two busy processes gets: ~1.0 each when two cores are
    free, ~0.5 when other work on the machine holds one (then no 2-worker run can scale)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(2) as pool:
        return [round(share, 3) for share in pool.map(_burn, [seconds, seconds])]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure-gloo", action="store_true", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--gloo-port", type=int, default=29500)
    parser.add_argument("--gloo-elements", type=int, default=69632)
    args = parser.parse_args(argv)
    print(json.dumps(measure_gloo(args.rank, args.gloo_port, args.gloo_elements)))


if __name__ == "__main__":
    main()
