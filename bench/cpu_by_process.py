"""Where a command's CPU goes, by kind of process: Ray Train workers and controllers, Ray's own daemons,
Dagster, the browser, pytest workers, the kernel.

On two cores `make test` is bound by CPU, not by waiting, so its wall time follows the CPU-seconds its
processes burn; this names who burns them. Every second it reads each process's cumulative CPU time
(user + system) and its kind (from the name Ray sets, else the command line); at the end it sums, per
kind, the last value seen of each process. A process that lives under a second is missed, and each
process loses at most its last second. The machine's other processes are counted too (their kind says so).

    .venv/bin/python -m bench.cpu_by_process -- .venv/bin/pytest -q -n 2 --dist loadfile
"""
from __future__ import annotations

import argparse
import collections
import os
import resource
import subprocess
import sys
import time

# Checked in order: the first match names the kind. (substring of the process name or command line, kind)
KINDS = [
    ("RayTrainWorker", "Ray Train worker"),
    ("TrainController", "Ray Train controller"),
    ("SynchronizationActor", "Ray Train synchronization actor"),
    ("DashboardAgent", "Ray dashboard agent"),
    ("dashboard", "Ray dashboard"),
    ("log_monitor", "Ray log monitor"),
    ("raylet", "Ray raylet"),
    ("gcs_server", "Ray GCS"),
    ("ray::", "other Ray actor or task"),
    ("default_worker.py", "Ray idle worker"),
    ("chrom", "browser"),
    ("headless_shell", "browser"),
    ("dagster", "Dagster process"),
    ("mlflow", "MLflow server"),
    ("exec(eval", "pytest-xdist worker"),
    ("pytest", "pytest"),
    ("tessera", "tessera CLI"),
    ("kdamond", "kernel (DAMON)"),
]


def kind_of(name: str, command_line: str) -> str:
    for marker, kind in KINDS:
        if marker in name or marker in command_line:
            return kind
    return "python (other)" if name.startswith("python") else f"other: {name}"


def sample(seen: dict, own_pid: int, since: float) -> None:
    """Record each live process's kind and CPU seconds used since ``since`` (a wall-clock time), keyed
    by (pid, start time): a process already running then counts from its first sample."""
    import psutil

    for process in psutil.process_iter():
        if process.pid == own_pid:
            continue
        try:
            times = process.cpu_times()
            started = process.create_time()
            kind = kind_of(process.name(), " ".join(process.cmdline())[:400])
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        cpu = times.user + times.system
        key = (process.pid, started)
        baseline = seen[key][1] if key in seen else (cpu if started < since else 0.0)
        seen[key] = (kind, baseline, cpu)  # the latest kind: a pooled Ray process changes its name


def cpu_by_kind(seen: dict) -> list[tuple[str, float, int]]:
    """(kind, CPU seconds, processes that used any), most CPU first."""
    seconds: collections.Counter = collections.Counter()
    processes: collections.Counter = collections.Counter()
    for kind, baseline, cpu in seen.values():
        if cpu > baseline:
            seconds[kind] += cpu - baseline
            processes[kind] += 1
    return [(kind, cpu, processes[kind]) for kind, cpu in seconds.most_common()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    seen: dict = {}
    since, started = time.time(), time.monotonic()
    child = subprocess.Popen(command)
    while child.poll() is None:
        sample(seen, os.getpid(), since)
        time.sleep(1.0)
    wall = time.monotonic() - started
    table = cpu_by_kind(seen)
    total = sum(cpu for _, cpu, _ in table)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the command and the descendants it waited for
    waited_for = children.ru_utime + children.ru_stime
    print(f"\n{wall:.0f} s wall, {total:.0f} CPU-s sampled ({os.cpu_count()} CPUs); the command and the "
          f"descendants it waited for used {waited_for:.0f} CPU-s; exit code {child.returncode}")
    for kind, cpu, count in table[:30]:
        print(f"{cpu:9.1f} CPU-s {100 * cpu / total:5.1f} %  {count:5d} process(es)  {kind}")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
