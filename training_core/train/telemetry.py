"""Step timing, throughput and MFU bookkeeping for one worker."""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

# Dense bf16 peak FLOP/s per device, for MFU. CPU has no meaningful peak: report achieved FLOP/s.
PEAK_FLOPS = {"a100": 312e12, "h100": 989e12, "h200": 989e12, "cpu": None}


def model_flops_per_token(parameters: int, trainable: int, layers: int, hidden: int, seq_len: int) -> float:
    """Forward 2N + activation-gradient 2N, plus weight gradients 2N only for trainable weights
    (LoRA freezes the rest), plus attention scores 12·L·H·T (as in the PaLM MFU formula)."""
    return 4.0 * parameters + 2.0 * trainable + 12.0 * layers * hidden * seq_len


@dataclass
class StepTimer:
    data_wait_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.perf_counter)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the wall time of the block to `<name>_s` (data_wait, forward, backward, optimizer)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, f"{name}_s", getattr(self, f"{name}_s") + time.perf_counter() - started)

    def summary(self, flops_per_token: float, preset: str, world_size: int) -> dict:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        busy = self.data_wait_s + self.forward_s + self.backward_s + self.optimizer_s
        tokens_per_s = self.tokens * world_size / elapsed
        achieved = tokens_per_s * flops_per_token
        peak = PEAK_FLOPS.get(preset)
        result = {
            **{k: v for k, v in asdict(self).items() if k.endswith("_s")},
            "steps": self.steps,
            "elapsed_s": elapsed,
            "tokens_per_s": tokens_per_s,
            "data_stall_fraction": self.data_wait_s / busy if busy else 0.0,
            "model_flops_per_token": flops_per_token,
            "achieved_flops_per_s": achieved,
            "peak_memory_mb": peak_memory_mb(),
        }
        if peak:
            result["mfu"] = achieved / (peak * world_size)
        return result


def peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
