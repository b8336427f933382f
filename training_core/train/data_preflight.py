"""The training data, checked in the driver before any Ray worker starts.

The pipeline's own datasets pass the `training_dataset` checks already; this catches data handed
to `run_training` directly (another writer, a hand-made folder), whose problems would otherwise
surface inside a worker, after start-up, without a file name: every file's token columns must be
lists of integers with no nulls, labels as wide as input_ids (one label per input token; a writer
that shifts labels itself stores one fewer), token ids must fit the base model's vocabulary (where the
footer's statistics give their range), and the data must hold one micro batch for every worker.
Footers are read (the same listing the reader does) and each file's first row, so it costs milliseconds.
"""
from __future__ import annotations

from collections.abc import Sequence

import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from training_core.data.batch_columns import TRAINING_COLUMNS
from training_core.data.parquet_files import is_integer_list, list_parquet_files, read_footer, retry_storage_errors
from training_core.errors import SourceDataError


IGNORED_LABEL = -100  # labels of padding and prompt tokens: no loss


def check_training_data(train_dirs: Sequence[str], micro_batch_size: int, num_workers: int,
                        vocab_size: int | None = None) -> int:
    """The number of training rows; raises ``SourceDataError`` naming the file and column at fault.
    With ``vocab_size``, a token id outside ``[0, vocab_size)`` (data tokenized for another model) is
    named with its row group; it would otherwise be an IndexError inside the embedding, in a worker."""
    filesystem, infos = list_parquet_files(list(train_dirs))
    rows = 0
    for info in infos:
        parquet_file, schema, has_nulls, _ = read_footer(filesystem, info)
        for name in TRAINING_COLUMNS:
            if name not in schema.names:
                raise SourceDataError(f"{info.path}: no column {name!r}; it has {schema.names}")
            kind = schema.field(name).type
            if not is_integer_list(kind):
                raise SourceDataError(f"{info.path}: column {name!r} is {kind}; training needs lists of integer token ids")
            if name in has_nulls:
                raise SourceDataError(f"{info.path}: column {name!r} holds nulls; training needs a full token list in every row")
        _check_label_width(filesystem, info)
        if vocab_size is not None:
            _check_token_ids(parquet_file, vocab_size)
        rows += sum(parquet_file.row_group_sizes)
    needed = micro_batch_size * num_workers
    if rows < needed:
        raise SourceDataError(
            f"{', '.join(map(str, train_dirs))}: {rows} training rows, fewer than one micro batch on every worker "
            f"(micro_batch_size {micro_batch_size} × num_workers {num_workers} = {needed})"
        )
    return rows


def _check_token_ids(parquet_file, vocab_size: int) -> None:
    for index, ranges in enumerate(parquet_file.value_ranges):  # row groups without statistics: unchecked
        for name, low, high in ranges:
            lowest_allowed = IGNORED_LABEL if name == "labels" else 0
            if name in TRAINING_COLUMNS and (high >= vocab_size or (low < 0 and low != lowest_allowed)):
                raise SourceDataError(
                    f"{parquet_file.path}: row group {index}: column {name!r} holds token ids {low}..{high}, outside the "
                    f"base model's vocabulary (0..{vocab_size - 1}); was it tokenized for another model?")


def _check_label_width(filesystem: pafs.FileSystem, info: pafs.FileInfo) -> None:
    """The first row's labels hold one label per input token. The model shifts labels itself, so
    labels one shorter (shifted by their writer) would otherwise fail inside a worker's loss with
    "Expected input batch_size (64) to match target batch_size (60)", naming no file."""

    def first_row_widths() -> dict[str, int | None]:  # empty file: {}; a null list: None (named by the worker)
        with filesystem.open_input_file(info.path) as handle:
            batch = next(pq.ParquetFile(handle).iter_batches(batch_size=1, columns=TRAINING_COLUMNS), None)
        return {} if batch is None else {name: pc.list_value_length(batch.column(name))[0].as_py()
                                         for name in TRAINING_COLUMNS}

    widths = retry_storage_errors(first_row_widths, f"{info.path} first row", max_attempts=3, backoff_s=0.05)
    if widths and None not in widths.values() and widths["labels"] != widths["input_ids"]:
        raise SourceDataError(
            f"{info.path}: row 0 holds {widths['input_ids']} input_ids but {widths['labels']} labels; training needs "
            f"one label per input token (the model shifts labels itself: store them unshifted, {IGNORED_LABEL} where no loss)")
