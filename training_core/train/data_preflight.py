"""The training data, checked in the driver before any Ray worker starts.

The pipeline's own datasets pass the `training_dataset` checks already; this catches data handed
to `run_training` directly (another writer, a hand-made folder), whose problems would otherwise
surface inside a worker, after start-up, without a file name: every file's token columns must be
lists of integers with no nulls, and the data must hold one micro batch for every worker.
Only footers are read (the same listing the reader does), so it costs milliseconds.
"""
from __future__ import annotations

from collections.abc import Sequence

from training_core.data.batch_columns import TRAINING_COLUMNS
from training_core.data.parquet_files import is_integer_list, list_parquet_files, read_footer
from training_core.errors import SourceDataError


def check_training_data(train_dirs: Sequence[str], micro_batch_size: int, num_workers: int) -> int:
    """The number of training rows; raises ``SourceDataError`` naming the file and column at fault."""
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
        rows += sum(parquet_file.row_group_sizes)
    needed = micro_batch_size * num_workers
    if rows < needed:
        raise SourceDataError(
            f"{', '.join(map(str, train_dirs))}: {rows} training rows, fewer than one micro batch on every worker "
            f"(micro_batch_size {micro_batch_size} × num_workers {num_workers} = {needed})"
        )
    return rows
