"""Training batches from the row-group reader, across epochs, as torch tensors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from training_core.data import CacheConfig, RowGroupReader
from training_core.data.batch_columns import TRAINING_COLUMNS, TRAINING_TRANSFORM, TRAINING_TRANSFORM_VERSION
from training_core.errors import SourceDataError
from training_core.train.config import TrainingConfig
from training_core.train.model_setup import model_dtype
from training_core.train.packed_attention import SlidingWindow, attention_inputs, packed_rows

# The cache quota where the caller names none (a cache warmed outside Dagster: tests, benchmarks);
# the lora_adapter asset passes the one the row_group_cache resource warmed with.
DEFAULT_CACHE_SIZE_LIMIT_BYTES = 1 << 30


class EpochBatches:
    """Cycles epochs of one rank's shard through one reader; each epoch has its own order.

    One reader for the whole run: the dataset listing and footers are read, and the cache opened,
    once, and the reader's buffer pools stay warm across epochs (a new reader per epoch cost
    ~11 ms at every epoch boundary on a local warm cache, more where listing a store is slow).
    `state_dict()` is the reader's global position, so a checkpoint resumes on the exact batch;
    `max_epochs` is checked before every epoch starts, a resumed one included.
    """

    def __init__(self, inputs, config: TrainingConfig, rank: int, world_size: int, epoch: int, state: dict | None):
        self._inputs, self._config = inputs, config
        self._rank, self._world_size = rank, world_size
        self._reader = self._open(epoch)
        if state is not None:
            self._reader.load_state_dict(state)  # its epoch is one past the saved one after an epoch's last batch
        self._iterator = self._start_epoch()

    def _open(self, epoch: int) -> RowGroupReader:
        inputs, config = self._inputs, self._config
        quota = inputs.cache_size_limit_bytes or DEFAULT_CACHE_SIZE_LIMIT_BYTES
        cache = CacheConfig(Path(inputs.cache_dir), quota, policy=inputs.cache_policy) if inputs.cache_dir else None
        return RowGroupReader(
            list(inputs.train_dirs),
            columns=TRAINING_COLUMNS,
            batch_size=config.micro_batch_size,
            seed=config.data_seed,
            epoch=epoch,
            shuffle=True,
            shuffle_buffer_row_groups=config.shuffle_buffer_row_groups,
            rank=self._rank,
            world_size=self._world_size,
            workers=config.loader_workers,
            cache=cache,
            drop_last=True,  # every rank takes the same number of steps (DDP / ZeRO need lockstep)
            # as row_group_cache warmed the cache, so that training reads what warming stored
            transform=TRAINING_TRANSFORM,
            transform_version=TRAINING_TRANSFORM_VERSION,
        )

    def _start_epoch(self) -> Iterator[dict] | None:
        """The reader's current epoch, or None once `max_epochs` are done. Every epoch starts here,
        a resumed one included: a state saved after the last batch of the last epoch already points
        past it, and serving that epoch would train one more than an uninterrupted run."""
        self.epoch = self._reader.epoch
        if self._config.max_epochs is not None and self.epoch >= self._config.max_epochs:
            return None
        return iter(self._reader)

    def next(self) -> dict[str, torch.Tensor] | None:
        """The next batch (input_ids, labels, position_ids: packed_attention.packed_rows), rolling into
        the next epoch; None once `max_epochs` are done."""
        for _ in range(2):
            if self._iterator is None:
                return None
            batch = next(self._iterator, None)
            if batch is not None:
                for name in TRAINING_COLUMNS:
                    if batch[name].dtype == object:  # the reader's form of ragged rows (or nulls)
                        raise SourceDataError(
                            f"{', '.join(map(str, self._inputs.train_dirs))}: column {name!r} has rows of different "
                            f"lengths in epoch {self._reader.epoch}; training needs every row to hold the same number of tokens"
                        )
                self._check_label_width(batch)
                return packed_rows(batch["input_ids"], batch["labels"])
            self._iterator = self._start_epoch()  # an epoch that ends moves the reader to the next one
        raise RuntimeError(f"epoch {self.epoch} of {self._inputs.train_dirs} yields no batch of {self._config.micro_batch_size} rows for rank {self._rank}")

    def _check_label_width(self, batch: dict) -> None:
        # The preflight reads each file's first row group only; a later row of another width would fail
        # inside the model's loss naming no data.
        inputs, labels = batch["input_ids"].shape[1], batch["labels"].shape[1]
        if labels != inputs:
            raise SourceDataError(
                f"{', '.join(map(str, self._inputs.train_dirs))}: a batch in epoch {self._reader.epoch} holds rows of "
                f"{inputs} input_ids but {labels} labels; training needs one label per input token"
            )

    def model_inputs(self, batch: dict[str, torch.Tensor], device: torch.device | str,
                     window: SlidingWindow | None = None) -> dict:
        """A batch as the model takes it, on the model's ``device`` (DeepSpeed's engine moves no
        inputs): each packed example attends only to itself, as evaluation scores it, within the model's
        sliding ``window`` (model_setup.sliding_window) if it has one. The mask (batch × seq² entries) is
        built on ``device``, for one micro-batch at a time."""
        return {**{name: tensor.to(device) for name, tensor in batch.items()},
                **attention_inputs(batch["position_ids"], self._config.attention, model_dtype(self._config), window, device)}

    def state_dict(self) -> dict:
        return self._reader.state_dict()

    def stats(self) -> dict[str, float]:
        """The reader's counters over every epoch of this run (rates and stall are left out: the
        telemetry computes its own over the training loop)."""
        return {key: value for key, value in self._reader.stats.as_dict().items()
                if isinstance(value, (int, float)) and not key.endswith("_per_s") and key != "stall_fraction"}

    def close(self) -> None:
        self._reader.close()
