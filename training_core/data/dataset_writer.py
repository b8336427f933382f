"""Writing a training dataset: packed train rows as Parquet plus a held-out eval split.

Layout of a published dataset (directory name = content digest, so it is immutable):
    train/part-00000.parquet …   input_ids, labels: list<int32>[seq_len]; row groups of
                                 `row_group_rows` rows (the loader's unit of work and caching)
    eval.parquet                 prompt, response (raw text, for eval loss and exact-match)
    manifest.json                counts, spec (seq_len, eval_fraction, …), tokenizer digest, source partitions,
                                 prompt_format when it is not plain
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from training_core.data.packing import (
    EVAL_SPLIT_METHOD,
    TEXT_EVAL_SPLIT_METHOD,
    RowPacker,
    SpecialTokensInText,
    check_fits,
    is_eval_example,
    require_layout_tokens,
    tokenize_examples,
)
from training_core.data.prompt_format import PLAIN, check_prompt_format_name, require_prompt_format
from training_core.data.sources import RecordLocations
from training_core.errors import ConfigError, EmptyPartitionError
from training_core.storage import directory_digest, publish_directory, staging_directory


EVAL_FILE = "eval.parquet"


@dataclass(frozen=True)
class DatasetSpec:
    seq_len: int = 64
    row_group_rows: int = 128
    rows_per_file: int = 1024
    eval_fraction: float = 0.05
    max_eval_examples: int = 200
    prompt_format: str = PLAIN  # prompt_format.PROMPT_FORMATS

    def __post_init__(self) -> None:
        for name in ("seq_len", "row_group_rows", "rows_per_file", "max_eval_examples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"DatasetSpec.{name} must be a whole number ≥ 1, got {value!r}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"DatasetSpec.eval_fraction must be between 0 and 1 (exclusive), got {self.eval_fraction!r}")
        check_prompt_format_name(self.prompt_format)

    def manifest_fields(self) -> dict:
        """The spec as manifest.json records it. A plain prompt format is left out, as manifests written
        before formats existed leave it out: the same records give the same bytes, hence the same digest."""
        fields = asdict(self)
        if self.prompt_format == PLAIN:
            del fields["prompt_format"]
        return fields


@dataclass(frozen=True)
class PublishedDataset:
    """What downstream assets receive: an immutable, content-addressed dataset."""

    path: str
    digest: str
    train_rows: int
    train_examples: int
    eval_examples: int  # written to eval.parquet: the held-out examples up to max_eval_examples
    row_groups: int
    files: int
    seq_len: int
    tokens: int
    # Names of the blocking quality checks this dataset failed: () when all passed, None when none
    # were recorded with it (written outside Dagster, or stored before checks were recorded).
    # Consumers launched on their own (a later day's training window) read it to refuse the day.
    failed_checks: tuple[str, ...] | None = None
    # How prompts were held out (packing.EVAL_SPLIT_METHOD) and what share: days of one training
    # window must share both, or a prompt held out on one day is trained on from another. None:
    # handed over before they were recorded here (the manifest has them: see eval_split).
    eval_split_method: str | None = None
    eval_fraction: float | None = None
    # Examples the split held out, scored or not: those beyond max_eval_examples are in neither split.
    held_out_examples: int | None = None
    prompt_format: str = PLAIN

    @property
    def train_dir(self) -> Path:
        return Path(self.path) / "train"

    def eval_split(self) -> tuple[str, float] | None:
        """(split method, eval_fraction) this dataset was held out with: the fields, or for a dataset
        handed over before they were recorded there, its manifest (a manifest naming no method was
        split by prompt text). None when neither tells."""
        if self.eval_split_method is not None and self.eval_fraction is not None:
            return self.eval_split_method, self.eval_fraction
        try:
            manifest = json.loads((Path(self.path) / "manifest.json").read_text())
            return (manifest.get("eval_split_method", TEXT_EVAL_SPLIT_METHOD),
                    float(manifest["spec"]["eval_fraction"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None


def _fixed_list(array: np.ndarray) -> pa.Array:
    rows, width = array.shape
    return pa.FixedSizeListArray.from_arrays(pa.array(array.reshape(-1), type=pa.int32()), width).cast(
        pa.list_(pa.int32())
    )


def write_dataset(
    records: Iterable[dict[str, str]],
    tokenizer,
    output_root: Path,
    spec: DatasetSpec,
    *,
    source_label: str,
    records_path: str | None = None,
    extra_manifest: dict | None = None,
) -> PublishedDataset:
    """Tokenize, split, pack and publish `records` under `output_root/<digest>`. `records_path`,
    when the records are one JSON Lines file in order (the frozen `raw_examples`), lets an error
    name a record's line there.

    Streams: `records` (a list, or a one-pass iterator such as `sources.iter_records`) are tokenized
    in batches, packed as they come and written a file at a time, so memory holds one batch of
    records and one file of rows, not the day. The bytes are those of packing everything first
    (same rows, same files, same row groups), so digests do not change."""
    records = iter(records)
    first = next(records, None)
    if first is None:
        raise EmptyPartitionError(f"{source_label}: no records to write")
    require_layout_tokens(tokenizer)
    require_prompt_format(tokenizer, spec.prompt_format)

    def describe(index: int, record: dict[str, str]) -> str:  # as the user can find it (only for an error)
        locations = RecordLocations(records_path)
        where = locations.frozen(index)
        if users := locations.users(index):
            where += f", from {users}"
        return f"{source_label}: {where} (prompt {record['prompt'][:40]!r})"

    packer = RowPacker(spec.seq_len, tokenizer.pad_token_id)
    special_tokens = SpecialTokensInText(tokenizer)
    eval_records: list[dict[str, str]] = []
    eval_count = train_examples = tokens = record_count = 0
    batches = batched(itertools.chain([first], records), _TOKENIZE_BATCH)
    with staging_directory(output_root) as staging:
        train_dir = staging / "train"
        train_dir.mkdir()
        files = _TrainFiles(train_dir, spec)
        for batch in batches:
            start, record_count = record_count, record_count + len(batch)
            # Eval records are checked like train ones, in record order, with the same messages: one
            # longer than seq_len would crash evaluation after training (positions beyond the model's),
            # one holding special tokens could never match.
            examples = tokenize_examples(tokenizer, [r["prompt"] for r in batch], [r["response"] for r in batch],
                                         spec.prompt_format)
            for index, (record, example) in enumerate(zip(batch, examples), start=start):
                where = functools.partial(describe, index, record)  # called at once, if at all
                special_tokens.check(example, where)
                if is_eval_example(example.prompt_ids, spec.eval_fraction):
                    check_fits(example, spec.seq_len, where)
                    eval_count += 1
                    if len(eval_records) < spec.max_eval_examples:
                        eval_records.append(record)
                    continue
                packer.add(example, where)
                tokens += len(example.prompt_ids) + len(example.response_ids)
                train_examples += 1
            files.add(packer.take_rows())
        if not train_examples:
            raise EmptyPartitionError(f"{source_label}: every record fell into the eval split")
        if not eval_count:
            # Refused here, not at evaluation: by then the window's model has trained for nothing.
            raise EmptyPartitionError(
                f"{source_label}: none of its {record_count} records fell into the eval split "
                f"(eval_fraction={spec.eval_fraction}, split by a hash of the prompt's tokens), so evaluation "
                "would have nothing to score; raise eval_fraction or add records"
            )
        packer.finish()
        files.add(packer.take_rows())
        files.close()
        pq.write_table(
            pa.table({"prompt": [r["prompt"] for r in eval_records], "response": [r["response"] for r in eval_records]}),
            staging / EVAL_FILE,
        )
        manifest = {
            "spec": spec.manifest_fields(),
            "source": source_label,
            "train_rows": files.rows,
            "train_examples": train_examples,
            "eval_examples": len(eval_records),
            "held_out_examples": eval_count,
            "eval_split_method": EVAL_SPLIT_METHOD,
            **(extra_manifest or {}),
        }
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
        digest = directory_digest(staging, record_files=True)
        final = publish_directory(staging, output_root / digest[:16])

    row_groups = sum(pq.ParquetFile(p).num_row_groups for p in sorted((final / "train").glob("*.parquet")))
    return PublishedDataset(
        path=str(final),
        digest=digest,
        train_rows=files.rows,
        train_examples=train_examples,
        eval_examples=len(eval_records),
        row_groups=row_groups,
        files=files.count,
        seq_len=spec.seq_len,
        tokens=tokens,
        eval_split_method=EVAL_SPLIT_METHOD,
        eval_fraction=spec.eval_fraction,
        held_out_examples=eval_count,
        prompt_format=spec.prompt_format,
    )


_TOKENIZE_BATCH = 2048  # records per batched tokenizer call


def batched(items: Iterable, size: int) -> Iterator[list]:
    """Lists of ``size`` items in order, the last maybe shorter (itertools.batched from Python 3.12)."""
    items = iter(items)
    while batch := list(itertools.islice(items, size)):
        yield batch


class _TrainFiles:
    """Packed rows to `part-NNNNN.parquet` files of `rows_per_file` rows, each written once full."""

    def __init__(self, directory: Path, spec: DatasetSpec) -> None:
        self.directory, self.spec = directory, spec
        self.count = self.rows = 0
        self._pending: list[dict[str, np.ndarray]] = []
        self._pending_rows = 0

    def add(self, rows: dict[str, np.ndarray]) -> None:
        if len(rows["input_ids"]):
            self._pending.append(rows)
            self._pending_rows += len(rows["input_ids"])
        while self._pending_rows >= self.spec.rows_per_file:
            self._write(self.spec.rows_per_file)

    def close(self) -> None:
        if self._pending_rows:
            self._write(self._pending_rows)

    def _write(self, count: int) -> None:
        joined = {name: np.concatenate([part[name] for part in self._pending]) for name in ("input_ids", "labels")}
        table = pa.table({name: _fixed_list(values[:count]) for name, values in joined.items()})
        pq.write_table(table, self.directory / f"part-{self.count:05d}.parquet",
                       row_group_size=self.spec.row_group_rows, compression="zstd")
        rest = {name: values[count:] for name, values in joined.items()}
        self._pending = [rest] if len(rest["input_ids"]) else []
        self._pending_rows -= count
        self.count += 1
        self.rows += count


def read_prompt_format(dataset_path: str | Path) -> str:
    """How the dataset laid out its prompts (prompt_format.PROMPT_FORMATS), from its manifest: evaluation
    and the quality checks tokenize held-out and source records the same way. A manifest that names none
    was written plain."""
    manifest_path = Path(dataset_path) / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
        prompt_format = manifest["spec"].get("prompt_format", PLAIN)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(f"training dataset {dataset_path}: {manifest_path.name} does not say how its prompts were "
                          f"laid out ({type(error).__name__}: {error}); rematerialize training_dataset") from error
    check_prompt_format_name(prompt_format)
    return prompt_format


def read_eval_records(dataset_path: str | Path) -> list[dict[str, str]]:
    """The held-out split of a published dataset (raw prompt / response text)."""
    return pq.read_table(Path(dataset_path) / EVAL_FILE).to_pylist()
