"""bench.cpu_by_process: which kind each process is counted as, and the per-kind sums it prints."""
from __future__ import annotations

import pytest

from bench.cpu_by_process import cpu_by_kind, kind_of


@pytest.mark.parametrize(("name", "command_line", "kind"), [
    ("ray::RayTrainWo", "ray::RayTrainWorker.__execute", "Ray Train worker"),
    ("ray::PooledProce", "ray::PooledProcessTrainController.run", "Ray Train controller"),
    ("ray::Dashboard", "ray::DashboardAgent", "Ray dashboard agent"),  # before the dashboard's own processes
    ("ray-dashboard-N", "ray-dashboard-NodeHead-0", "Ray dashboard"),
    ("ray::IDLE", "ray::IDLE", "other Ray actor or task"),
    ("python", "python -u .../ray/_private/workers/default_worker.py --node-ip-address=...", "Ray idle worker"),
    ("python", "python -c import sys;exec(eval(sys.stdin.readline()))", "pytest-xdist worker"),
    ("python", "python -m dagster dev -w workspace.yaml", "Dagster process"),
    ("python", "python script.py", "python (other)"),
    ("kworker/0:1", "", "other: kworker/0:1"),
])
def test_each_process_is_counted_under_its_kind(name, command_line, kind):
    assert kind_of(name, command_line) == kind


def test_the_sums_add_what_each_process_used_while_measured_most_cpu_first():
    seen = {(1, 0.0): ("Ray Train worker", 0.0, 12.0), (2, 0.0): ("Ray Train worker", 0.0, 10.5),
            (1, 5.0): ("Dagster process", 0.0, 3.0),  # pid 1 reused: another process
            (3, 0.0): ("pytest", 0.0, 40.0),
            (4, 0.0): ("MLflow server", 100.0, 101.5),  # already running: only what it used since
            (5, 0.0): ("browser", 7.0, 7.0)}  # idle throughout: not listed
    assert cpu_by_kind(seen) == [("pytest", 40.0, 1), ("Ray Train worker", 22.5, 2), ("Dagster process", 3.0, 1),
                                 ("MLflow server", 1.5, 1)]
