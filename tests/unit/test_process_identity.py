"""A process's recorded identity survives a step of the wall clock (an NTP step, a VM resume), which
moves psutil's create_time() of every live process; a reboot, a reused PID and identities written
before boot ids were recorded are still judged."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from training_core.process_identity import process_is_gone, this_process

linux_only = pytest.mark.skipif(not Path("/proc/sys/kernel/random/boot_id").exists(),
                                reason="boot ids and start ticks are read from Linux's /proc")


@pytest.fixture
def live_child():
    """A live process whose command name holds spaces and parentheses, and its recorded identity."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path\n"
         "Path('/proc/self/comm').write_text('a) b (c 1 2')\n"
         "from training_core.process_identity import this_process\n"
         "print(this_process(), flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        yield child.stdout.readline().strip()
    finally:
        child.kill()
        child.wait()


def _step_the_wall_clock(monkeypatch, seconds: float) -> None:
    # psutil's create_time() adds /proc/stat's boot time, which the kernel recomputes from the wall clock.
    import psutil._pslinux

    before = psutil.Process().create_time()
    stepped = psutil._pslinux.boot_time() + seconds
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: stepped)
    assert psutil.Process().create_time() == pytest.approx(before + seconds)  # the step reaches psutil


@linux_only
@pytest.mark.parametrize("step_s", [1.0, -3600.0])
def test_a_live_process_is_not_gone_after_the_wall_clock_steps(monkeypatch, live_child, step_s):
    me = this_process()
    assert not process_is_gone(me) and not process_is_gone(live_child)
    _step_the_wall_clock(monkeypatch, step_s)
    assert not process_is_gone(me)
    assert not process_is_gone(live_child)


@linux_only
def test_a_reused_pid_a_free_pid_and_a_reboot_are_gone(live_child):
    host, pid, start = this_process().rsplit(":", 2)
    ticks, boot = start.split("@")
    assert ":" not in start and "-" not in start  # identities and staging folder names are read from the right
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert process_is_gone(f"{host}:{pid}:{int(ticks) - 100}@{boot}")  # our PID, started at another time
    assert process_is_gone(f"{host}:{finished.stdout.strip()}:{ticks}@{boot}")  # exited
    child_pid, child_start = live_child.rsplit(":", 2)[1:]
    # read past the command name 'a) b (c 1 2': the ticks psutil counts from boot to the child's start
    child = psutil.Process(int(child_pid))
    boot_to_start_s = child.create_time() - psutil.boot_time()
    assert int(child_start.split("@")[0]) == pytest.approx(boot_to_start_s * os.sysconf("SC_CLK_TCK"), abs=1)
    assert process_is_gone(f"{live_child.rsplit(':', 1)[0]}:{child_start.split('@')[0]}@{'0' * 32}")  # host rebooted
    assert not process_is_gone(f"another-host:{pid}:{int(ticks) - 100}@{'0' * 32}")  # not judged from here


def test_identities_written_before_boot_ids_are_compared_by_their_create_time(monkeypatch):
    """The previous format, `<host>:<pid>:<create_time>`: a live process is kept as before."""
    host = socket.gethostname()
    old_format = f"{host}:{os.getpid()}:{psutil.Process().create_time():.3f}"
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert not process_is_gone(old_format)
    assert process_is_gone(f"{host}:{os.getpid()}:{psutil.Process().create_time() - 60:.3f}")  # PID reused
    assert process_is_gone(f"{host}:{finished.stdout.strip()}:1.000")  # exited
    assert not process_is_gone(f"{host}:{os.getpid()}:not-a-start")  # not written by this_process: left alone
