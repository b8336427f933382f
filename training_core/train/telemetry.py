"""Step timing, throughput and MFU bookkeeping for one worker."""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

# Dense bf16 peak FLOP/s per device, for MFU. CPU has no meaningful peak: report achieved FLOP/s.
PEAK_FLOPS = {"a100": 312e12, "h100": 989e12, "h200": 989e12, "cpu": None}


def resolve_peak_preset(preset: str, device_name: str | None) -> str:
    """The PEAK_FLOPS key for this worker: 'auto' reads the GPU's name ("NVIDIA H100 80GB HBM3" → h100);
    no GPU, or one not in the table, is 'cpu' (achieved FLOP/s only, no MFU)."""
    if preset != "auto":
        return preset
    name = (device_name or "").lower()
    return next((gpu for gpu in ("h200", "h100", "a100") if gpu in name), "cpu")


def model_flops_per_token(frozen_matmul_weights: int, trainable_matmul_weights: int, layers: int,
                          attention_width: int, seq_len: int) -> float:
    """Training FLOPs per token, as in PaLM's MFU formula, counting only weights that multiply
    (linear layers; embeddings are lookups): forward 2N + activation gradients 2N for every such
    weight, weight gradients 2N only for trainable ones (LoRA freezes the rest), plus attention
    scores and values 12·L·(heads·head_dim)·T."""
    weights = frozen_matmul_weights + trainable_matmul_weights
    return 4.0 * weights + 2.0 * trainable_matmul_weights + 12.0 * layers * attention_width * seq_len


STEP_PHASES = ("data_wait", "forward", "backward", "optimizer")


@dataclass
class StepTimer:
    """Where one worker's training loop spends its wall time.

    The loop's wall time (`elapsed_s`, from creation to `summary`) splits into checkpoint time
    (`checkpoint_s`: every `checkpoint()` block) and training time, the rest: the step phases plus
    the bookkeeping between them. Throughput (tokens/s, FLOP/s, MFU) is over training time, so a
    run that checkpoints more often does not look slower at the same step speed."""

    data_wait_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    checkpoint_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    # Wall and CPU clocks, replaceable in tests.
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False, compare=False)
    cpu_clock: Callable[[], float] = field(default=time.thread_time, repr=False, compare=False)
    # Waits for the work queued on the accelerator (torch.cuda.synchronize on GPU), where the loop's
    # time is split: otherwise a checkpoint's first device-to-host copy would wait for the last
    # steps' kernels, and their time would count as checkpoint time.
    synchronize: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    started: float | None = None  # clock() at creation unless given
    # Wall minus this thread's CPU time, per phase: on CPU, where the step thread blocks. In
    # backward and optimizer that is mostly waiting on collectives (gradient reduce, all-gather);
    # with several intra-op threads it also includes waiting for them. On GPU it is launch/sync.
    blocked: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    _checkpoint_cpu_s: float = field(default=0.0, init=False, repr=False)
    _open_checkpoint: tuple[float, float] | None = field(default=None, init=False, repr=False)  # (wall, cpu) start

    def __post_init__(self) -> None:
        if self.started is None:
            self.started = self.clock()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the wall time of the block to `<name>_s` (data_wait, forward, backward, optimizer),
        less any checkpoint taken inside it: each second counts once, as a phase or as a checkpoint."""
        if self._open_checkpoint is not None:  # inside a checkpoint: that owns the time
            yield
            return
        started, cpu_started = self.clock(), self.cpu_clock()
        checkpoint_before, checkpoint_cpu_before = self.checkpoint_s, self._checkpoint_cpu_s
        try:
            yield
        finally:
            wall = self.clock() - started - (self.checkpoint_s - checkpoint_before)
            cpu = self.cpu_clock() - cpu_started - (self._checkpoint_cpu_s - checkpoint_cpu_before)
            setattr(self, f"{name}_s", getattr(self, f"{name}_s") + wall)
            self.blocked[name] = self.blocked.get(name, 0.0) + wall - cpu

    @contextlib.contextmanager
    def checkpoint(self) -> Iterator[None]:
        """Count the block as `checkpoint_s` (checkpoint writes, loss reduction, ray.train.report),
        not as training time, between steps or inside a phase. A block nested in another counts once."""
        if self._open_checkpoint is not None:
            yield
            return
        self._wait_for_device()  # the steps' queued work is training time
        self._open_checkpoint = (self.clock(), self.cpu_clock())
        try:
            yield
        finally:
            self._wait_for_device()
            self._close_checkpoint()

    def summary(self, flops_per_token: float, preset: str, world_size: int) -> dict:
        self._wait_for_device()
        now = self.clock()
        elapsed = max(now - self.started, 1e-9)
        # Called inside a checkpoint (nothing does so today): its time so far is checkpoint time.
        checkpoint = self.checkpoint_s + (now - self._open_checkpoint[0] if self._open_checkpoint else 0.0)
        training = max(elapsed - checkpoint, 1e-9)
        busy = self.data_wait_s + self.forward_s + self.backward_s + self.optimizer_s
        tokens_per_s = self.tokens * world_size / training
        achieved = tokens_per_s * flops_per_token
        peak = PEAK_FLOPS.get(preset)
        result = {
            **{f"{phase}_s": getattr(self, f"{phase}_s") for phase in STEP_PHASES},
            "checkpoint_s": checkpoint,
            **{f"{phase}_blocked_s": seconds for phase, seconds in self.blocked.items()},
            "steps": self.steps,
            "elapsed_s": elapsed,
            "tokens_per_s": tokens_per_s,
            "data_stall_fraction": self.data_wait_s / busy if busy else 0.0,
            "model_flops_per_token": flops_per_token,
            "achieved_flops_per_s": achieved,
            "peak_memory_mb": peak_memory_mb(),
        }
        if peak:
            result["peak_flops_per_s"] = peak
            result["mfu"] = achieved / (peak * world_size)
        return result

    def _close_checkpoint(self) -> None:
        wall_started, cpu_started = self._open_checkpoint
        self.checkpoint_s += self.clock() - wall_started
        self._checkpoint_cpu_s += self.cpu_clock() - cpu_started
        self._open_checkpoint = None

    def _wait_for_device(self) -> None:
        if self.synchronize is not None:
            self.synchronize()


class StartupClock:
    """Wall-clock marks from the driver's launch to the first step, as `startup_<phase>_s` durations.

    `time.time()` rather than a monotonic clock because the launch mark is taken in the driver
    process; on one machine (or NTP-synced nodes) the split is accurate to milliseconds."""

    def __init__(self, launched_at: float | None) -> None:
        self._last = launched_at if launched_at is not None else time.time()
        self.durations: dict[str, float] = {}

    def mark(self, phase: str, at: float | None = None) -> None:
        now = time.time() if at is None else at
        self.durations[f"startup_{phase}_s"] = now - self._last
        self._last = now


def peak_memory_mb() -> float:
    import torch  # here, not at module level: the Dagster code location imports STEP_PHASES

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
