"""Step timing, throughput and MFU bookkeeping for one worker."""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

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
    data_wait_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    # Wall minus this thread's CPU time, per phase: on CPU, where the step thread blocks. In
    # backward and optimizer that is mostly waiting on collectives (gradient reduce, all-gather);
    # with several intra-op threads it also includes waiting for them. On GPU it is launch/sync.
    blocked: dict[str, float] = field(default_factory=dict)  # phase -> seconds

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the wall time of the block to `<name>_s` (data_wait, forward, backward, optimizer)."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            wall = time.perf_counter() - started
            setattr(self, f"{name}_s", getattr(self, f"{name}_s") + wall)
            self.blocked[name] = self.blocked.get(name, 0.0) + wall - (time.thread_time() - cpu_started)

    def summary(self, flops_per_token: float, preset: str, world_size: int) -> dict:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        busy = self.data_wait_s + self.forward_s + self.backward_s + self.optimizer_s
        tokens_per_s = self.tokens * world_size / elapsed
        achieved = tokens_per_s * flops_per_token
        peak = PEAK_FLOPS.get(preset)
        result = {
            **{k: v for k, v in asdict(self).items() if k.endswith("_s")},
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
