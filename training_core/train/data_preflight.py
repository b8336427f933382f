"""The training data, checked in the driver before any Ray worker starts.

The pipeline's own datasets pass the `training_dataset` checks already; this catches data handed
to `run_training` directly (another writer, a hand-made folder), whose problems would otherwise
surface inside a worker, after start-up, without a file name: every file's token columns must be
lists of integers with no nulls, labels as wide as input_ids (one label per input token; a writer
that shifts labels itself stores one fewer), token ids must fit the base model's vocabulary (where the
footer's statistics give their range), rows must be laid out as Tessera packs them (each row's trained
tokens end in the base model's eos: training reads example bounds from that layout), and the data
must hold one micro batch for every worker. Footers are read (the same listing the reader does) and
each file's first row group, so it costs milliseconds.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from training_core.data.batch_columns import TRAINING_COLUMNS
from training_core.data.packing import IGNORE_INDEX
from training_core.data.parquet_files import is_integer_list, list_parquet_files, read_footer, retry_storage_errors
from training_core.errors import SourceDataError




def base_model_eos_token_ids(model_path: str, model_config) -> frozenset[int]:
    """Every id the base model ends text with: the eos_token_id of its config.json (and of its text
    config: Gemma 3 nests one) and of its generation_config.json, each one id or a list, and its
    tokenizer's eos, which the dataset writer ends each example with (a tokenizer saved with another
    eos than the configs name, as for chat fine-tuning of a base model). Files the folder lacks give
    none (training reads no tokenizer); ``model_config``: its config.json, already loaded."""
    from transformers import AutoTokenizer, GenerationConfig

    # getattr: transformers 5 gives a composite config (Gemma 3) no top-level eos_token_id attribute
    # when its config.json names none; its text config does.
    named = [getattr(model_config, "eos_token_id", None), getattr(model_config.get_text_config(), "eos_token_id", None)]
    try:
        named.append(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except OSError:  # no generation_config.json
        pass
    try:
        named.append(AutoTokenizer.from_pretrained(model_path).eos_token_id)
    except (OSError, ValueError):  # no tokenizer files (ValueError: none transformers can use)
        pass
    return frozenset(int(token) for ids in named if ids is not None
                     for token in (ids if isinstance(ids, (list, tuple)) else [ids]))


def check_training_data(train_dirs: Sequence[str], micro_batch_size: int, num_workers: int,
                        vocab_size: int | None = None, eos_token_ids: Collection[int] = ()) -> int:
    """The number of training rows; raises ``SourceDataError`` naming the file and column at fault.
    With ``vocab_size``, a token id outside ``[0, vocab_size)`` (data tokenized for another model) is
    named with its row group; it would otherwise be an IndexError inside the embedding, in a worker.
    With ``eos_token_ids`` (:func:`base_model_eos_token_ids`), a row of a file's first row group whose
    trained tokens do not end in one of them is named (:func:`_check_first_row_group`)."""
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
        _check_first_row_group(filesystem, info, frozenset(eos_token_ids))
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
            lowest_allowed = IGNORE_INDEX if name == "labels" else 0
            if name in TRAINING_COLUMNS and (high >= vocab_size or (low < 0 and low != lowest_allowed)):
                raise SourceDataError(
                    f"{parquet_file.path}: row group {index}: column {name!r} holds token ids {low}..{high}, outside the "
                    f"base model's vocabulary (0..{vocab_size - 1}); was it tokenized for another model?")


def _check_first_row_group(filesystem: pafs.FileSystem, info: pafs.FileInfo, eos_token_ids: frozenset[int]) -> None:
    """The rows of the file's first row group (a bounded read; the worker checks label widths of
    every batch): each holds one label per input token, and, given ``eos_token_ids``, each row that
    trains anything ends its trained tokens with an eos.

    Labels one shorter (shifted by their writer: the model shifts labels itself) would otherwise fail
    inside a worker's loss with "Expected input batch_size (64) to match target batch_size (60)",
    naming no file. A row not laid out as Tessera packs (one example a row without eos, from another
    writer) would train wrongly without any error: training reads a row's last trained token as its
    eos (packing.row_eos_tokens) and starts a new example after every earlier trained occurrence of
    that token, cutting examples apart mid-response."""

    def first_row_group() -> pa.Table | None:  # empty file: None
        with filesystem.open_input_file(info.path) as handle:
            parquet_file = pq.ParquetFile(handle)
            return parquet_file.read_row_group(0, columns=TRAINING_COLUMNS) if parquet_file.num_row_groups else None

    table = retry_storage_errors(first_row_group, f"{info.path} first row group", max_attempts=3,
                                 backoff_s=0.05)
    if table is None:
        return
    null = pc.or_(table.column("input_ids").is_null(), table.column("labels").is_null())
    complete = np.flatnonzero(~null.to_numpy(zero_copy_only=False))  # a row with a null list: the worker names it
    input_ids, labels = (table.column(name).take(complete).combine_chunks() for name in ("input_ids", "labels"))
    id_widths, label_widths = (pc.list_value_length(column).to_numpy() for column in (input_ids, labels))
    if (unequal := np.flatnonzero(id_widths != label_widths)).size:
        row = unequal[0]
        raise SourceDataError(
            f"{info.path}: row {complete[row]} holds {id_widths[row]} input_ids but {label_widths[row]} labels; "
            f"training needs one label per input token (the model shifts labels itself: store them unshifted, "
            f"{IGNORE_INDEX} where no loss)")
    if eos_token_ids:
        _check_rows_end_in_eos(info.path, input_ids, labels, complete, eos_token_ids)


def _check_rows_end_in_eos(path: str, input_ids: pa.Array, labels: pa.Array, row_numbers: np.ndarray,
                           eos_token_ids: frozenset[int]) -> None:
    """Each row's last trained token is an eos (rows that train nothing are skipped). ``input_ids``
    and ``labels``: list arrays of equal row widths; ``row_numbers``: each row's number in the file."""
    flat_ids, flat_labels = (pc.list_flatten(column).to_numpy() for column in (input_ids, labels))
    trained = np.flatnonzero(flat_labels != IGNORE_INDEX)
    if not trained.size:
        return
    row_of_trained = pc.list_parent_indices(labels).to_numpy()[trained]
    is_last_of_row = np.append(row_of_trained[1:] != row_of_trained[:-1], True)
    last_tokens, rows = flat_ids[trained[is_last_of_row]], row_of_trained[is_last_of_row]
    if (wrong := np.flatnonzero(~np.isin(last_tokens, list(eos_token_ids)))).size:
        row, token = rows[wrong[0]], last_tokens[wrong[0]]
        raise SourceDataError(
            f"{path}: row {row_numbers[row]}: its last trained token is {token}, not the base model's eos "
            f"({', '.join(map(str, sorted(eos_token_ids)))}); training needs rows laid out as Tessera packs them: "
            f"examples back to back from the row start, each ending in an eos whose label is trained (not "
            f"{IGNORE_INDEX}), padding after the last one. Write the data with training_core.data.dataset_writer, "
            "or end each example's tokens and labels with the base model's eos")
