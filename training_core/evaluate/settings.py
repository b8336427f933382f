"""Where and how an evaluation runs: device, precision, batch size (no torch at import).

The same settings must be used to reproduce a run's eval metrics bit for bit (bf16 and a GPU give
other losses than fp32 on a CPU, and the batch size changes padding widths), so they are recorded
on the MLflow run as tags (``TAG_PREFIX`` + name) next to the metrics they produced. Tags, not
params: a finished run that is reused on a later day is evaluated again, perhaps with other
settings, and MLflow refuses to change a param.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from training_core.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16")
TAG_PREFIX = "tessera.eval."


@dataclass(frozen=True)
class EvalSettings:
    """``device="auto"``: the GPU when the process that evaluates sees one, else the CPU."""

    device: str = "auto"
    precision: str = "fp32"
    batch_size: int = 64

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"evaluation device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"evaluation precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"evaluation batch_size must be a positive integer, got {self.batch_size!r}")
        if self.device == "cpu" and self.precision == "bf16":
            raise ConfigError("evaluation precision='bf16' needs a GPU; use device='cuda' (or 'auto' on a GPU "
                              "machine) or precision='fp32'")

    def resolve(self, cuda_available: bool) -> "EvalSettings":
        """The concrete settings for a process that does (or does not) see a CUDA GPU."""
        if self.device == "cuda" and not cuda_available:
            raise ConfigError("evaluation device='cuda' but the process that evaluates sees no CUDA GPU; use "
                              "device='auto' or 'cpu'")
        device = self.device if self.device != "auto" else ("cuda" if cuda_available else "cpu")
        if self.precision == "bf16" and device != "cuda":
            raise ConfigError("evaluation precision='bf16' needs a GPU, and the process that evaluates sees no "
                              "CUDA GPU; use precision='fp32'")
        return EvalSettings(device, self.precision, self.batch_size)

    def for_this_process(self) -> "EvalSettings":
        import torch

        return self.resolve(torch.cuda.is_available())

    def as_tags(self) -> dict[str, str]:
        return {f"{TAG_PREFIX}{name}": str(value) for name, value in
                (("device", self.device), ("precision", self.precision), ("batch_size", self.batch_size))}

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> "EvalSettings":
        """The settings a run's eval metrics were produced with. Runs evaluated before these tags existed were
        evaluated on the CPU in fp32, 64 examples per batch."""
        found = {name: tags[TAG_PREFIX + name] for name in ("device", "precision", "batch_size")
                 if TAG_PREFIX + name in tags}
        try:
            batch_size = int(found.get("batch_size", cls.batch_size))
        except ValueError:
            raise ConfigError(f"MLflow tag {TAG_PREFIX}batch_size is not an integer: "
                              f"{found['batch_size']!r}") from None
        return cls(found.get("device", "cpu"), found.get("precision", "fp32"), batch_size)
