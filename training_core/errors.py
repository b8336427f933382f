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
    """The training loss or the trained weights became inf or NaN."""
