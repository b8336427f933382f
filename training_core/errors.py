"""Typed errors a user can act on. Each message names the file, row or field at fault."""


class TesseraError(Exception):
    """Base class for every error Tessera raises on purpose."""


class SourceDataError(TesseraError):
    """A source record or file is missing, unreadable or malformed."""


class EmptyPartitionError(SourceDataError):
    """A partition produced no usable records."""


class ConfigError(TesseraError, ValueError):
    """A configuration asks for something impossible or unsupported on this machine."""


class ModelNotFoundError(TesseraError):
    """A base model reference points at nothing loadable."""


class LineageError(TesseraError):
    """A recorded input is gone or no longer matches its digest."""


class TrainingDivergedError(TesseraError):
    """The training loss or the trained weights became inf or NaN. ``loss_history``: the run's finite
    losses ``(step, loss)`` up to the step it names, which the run's MLflow record shows as its curve."""

    def __init__(self, message: str, loss_history: list[tuple[int, float]] | None = None):
        super().__init__(message)  # args stay (message,): pickled as cls(message) plus this attribute
        self.loss_history = [(int(step), float(loss)) for step, loss in loss_history or []]
