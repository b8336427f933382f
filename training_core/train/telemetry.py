"""Step timing, throughput and MFU bookkeeping for one worker."""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from training_core.data.packing import content_lengths

# Dense bf16 peak FLOP/s per device, for MFU. CPU has no meaningful peak: report achieved FLOP/s.
PEAK_FLOPS = {"a100": 312e12, "h100": 989e12, "h200": 989e12, "cpu": None}


def resolve_peak_preset(preset: str, device_name: str | None) -> str:
    """The PEAK_FLOPS key for this worker: 'auto' reads the GPU's name ("NVIDIA H100 80GB HBM3" → h100);
    no GPU, or one not in the table, is 'cpu' (achieved FLOP/s only, no MFU)."""
    if preset != "auto":
        return preset
    name = (device_name or "").lower()
    return next((gpu for gpu in ("h200", "h100", "a100") if gpu in name), "cpu")


@dataclass(frozen=True)
class ModelFlops:
    """Training FLOPs of a model, as in PaLM's MFU formula (Chowdhery et al. 2022, appendix B),
    counting only weights that multiply (linear layers; embeddings are lookups): per token, forward
    2N + activation gradients 2N for every such weight, weight gradients 2N only for trainable ones
    (LoRA freezes the rest), plus attention scores and values, forward and backward,
    12·L·(heads·head_dim)·T for a token of a sequence of T tokens. Like PaLM, attention is not halved
    for causality: a sequence of T tokens costs 12·L·d·T² of it."""

    frozen_matmul_weights: int
    trainable_matmul_weights: int
    layers: int
    attention_width: int  # heads × head_dim (model_setup.attention_shape)

    def per_token(self, sequence_length: int) -> float:
        """FLOPs for one token of a sequence of ``sequence_length`` tokens."""
        weights = self.frozen_matmul_weights + self.trainable_matmul_weights
        dense = 4.0 * weights + 2.0 * self.trainable_matmul_weights
        return dense + 12.0 * self.layers * self.attention_width * sequence_length

    def of_packed_rows(self, labels: np.ndarray, position_ids: np.ndarray) -> tuple[int, float]:
        """(tokens, FLOPs) of packed rows as the loop trains them (packed_attention.packed_rows): each
        example attends only within itself, so one of l tokens costs l·per_token(l) whatever the row's
        width; padding is no model work (though sdpa and eager attention compute it) and counts in neither."""
        lengths = packed_example_lengths(labels, position_ids)
        tokens = int(lengths.sum())
        squares = float(np.square(lengths, dtype=np.float64).sum())
        return tokens, tokens * self.per_token(0) + 12.0 * self.layers * self.attention_width * squares


def model_flops_per_token(frozen_matmul_weights: int, trainable_matmul_weights: int, layers: int,
                          attention_width: int, seq_len: int) -> float:
    """Training FLOPs per token of sequences of ``seq_len`` tokens, each one whole example
    (:class:`ModelFlops`): what a benchmark on rows of one example each does."""
    return ModelFlops(frozen_matmul_weights, trainable_matmul_weights, layers, attention_width).per_token(seq_len)


def packed_example_lengths(labels: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
    """Every example's length in tokens across packed rows ([n, width] labels and position ids, as
    packed_attention.packed_rows gives them), padding left out. An example starts where its position
    id is 0; a row's content ends with its last trained label, its last example's eos
    (packing.content_lengths): the padding after it is not part of that example."""
    starts = position_ids == 0
    content = np.arange(labels.shape[1]) < content_lengths(labels)[:, None]
    # Each row starts an example, so numbering the starts over the flattened rows numbers every example.
    example = np.cumsum(starts.ravel()) - 1
    return np.bincount(example[content.ravel()])


# What tokens_per_s, achieved_flops_per_s, model_flops_per_token and mfu count, recorded with each run
# (MLflow tag tessera.throughput_counting) so that dashboards can tell a change of definition from a
# change of speed: runs without the tag (before 2026-12-06) counted padding as tokens and charged
# every token attention over its whole row, reading about 14 % (tokens) and 20 % (MFU) higher.
THROUGHPUT_COUNTING = "example tokens, attention within each example"

STEP_PHASES = ("data_wait", "forward", "backward", "optimizer")


@dataclass
class StepTimer:
    """Where one worker's training loop spends its wall time.

    The loop's wall time (`elapsed_s`, from creation to `summary`) splits into checkpoint time
    (`checkpoint_s`: every `checkpoint()` block) and training time, the rest: the step phases plus
    the bookkeeping between them. Throughput (tokens/s, FLOP/s, MFU) is over training time, so a
    run that checkpoints more often does not look slower at the same step speed.

    `tokens` and `model_flops` are what the loop adds per micro-batch (:meth:`ModelFlops.of_packed_rows`):
    tokens of examples, padding left out, and the model FLOPs of exactly those batches."""

    data_wait_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    checkpoint_s: float = 0.0
    steps: int = 0
    tokens: int = 0  # trained through the model: padding left out
    model_flops: float = 0.0
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

    def add_batch(self, tokens: int, model_flops: float) -> None:
        self.tokens += tokens
        self.model_flops += model_flops

    def summary(self, preset: str, world_size: int) -> dict:
        """Throughput of this worker's batches, times ``world_size`` for the whole run: `tokens_per_s`
        counts tokens of examples (no padding); `model_flops_per_token` is the run's average."""
        self._wait_for_device()
        now = self.clock()
        elapsed = max(now - self.started, 1e-9)
        # Called inside a checkpoint (nothing does so today): its time so far is checkpoint time.
        checkpoint = self.checkpoint_s + (now - self._open_checkpoint[0] if self._open_checkpoint else 0.0)
        training = max(elapsed - checkpoint, 1e-9)
        busy = self.data_wait_s + self.forward_s + self.backward_s + self.optimizer_s
        tokens_per_s = self.tokens * world_size / training
        achieved = self.model_flops * world_size / training
        peak = PEAK_FLOPS.get(preset)
        result = {
            **{f"{phase}_s": getattr(self, f"{phase}_s") for phase in STEP_PHASES},
            "checkpoint_s": checkpoint,
            **{f"{phase}_blocked_s": seconds for phase, seconds in self.blocked.items()},
            "steps": self.steps,
            "elapsed_s": elapsed,
            "tokens_per_s": tokens_per_s,
            "data_stall_fraction": self.data_wait_s / busy if busy else 0.0,
            "model_flops_per_token": self.model_flops / self.tokens if self.tokens else 0.0,
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
