"""raw_examples → training_dataset: source records for a day, then tokenized, packed Parquet."""


from dataclasses import dataclass, replace
from typing import Literal

import dagster as dg
from pydantic import Field

from assets.partitions import DAILY, daily_blocking_check
from assets.step_start import start_step
from resources import TesseraStorage
from training_core.base_model import BaseModelRef, check_context_length, load_tokenizer
from training_core.data.dataset_writer import DatasetSpec, PublishedDataset, write_dataset
from training_core.data.demo_task import MAX_RECORDS_PER_PARTITION, generate_records
from training_core.data.frozen_records import freeze_records
from training_core.data.quality import DATASET_CHECK_NAMES, MAX_REPEATED_RECORDS, run_dataset_checks
from training_core.data.sources import RecordOrigins, iter_records
from training_core.redaction import redact_uri


@dataclass(frozen=True)
class RawPartition:
    path: str
    records: int
    digest: str


class RawExamplesConfig(dg.Config):
    source: str = Field(
        "demo",
        description="'demo' generates the cipher task from the partition key; otherwise a JSONL/CSV/Parquet "
        "file or folder (a path, or a URI such as s3://bucket/exports/) with `prompt` and `response` fields; "
        ".jsonl/.ndjson/.json/.csv may be gzipped (.gz), and a folder must hold only such files (hidden and "
        "_-prefixed names are skipped; a _temporary/ holding files, an export still being written, is refused). "
        "'{partition}' is replaced by the day.",
        min_length=1,
    )
    records_per_partition: int = Field(
        4000, gt=0, le=MAX_RECORDS_PER_PARTITION,
        description=f"demo only: records generated per day (at most {MAX_RECORDS_PER_PARTITION:,}: more would "
        "repeat words over the no_duplicate_rows limit; use more days for more data)",
    )
    seed: int = Field(0, description="demo only: generator seed")


@dg.asset(partitions_def=DAILY, group_name="data", kinds={"parquet"})
def raw_examples(context: dg.AssetExecutionContext, config: RawExamplesConfig, storage: TesseraStorage):
    """Source records (prompt, response) for one day, frozen as JSONL under datasets/raw/."""
    start_step(context)
    day = context.partition_key
    origins = None
    # Messages name the file or folder read for this day, not the template.
    source = config.source.replace("{partition}", day)
    if config.source == "demo":
        records = generate_records(day, config.records_per_partition, config.seed)
    else:
        origins = RecordOrigins()
        records = iter_records(source, origins)  # read as written: memory holds a record, not the day
    shown = redact_uri(source)  # the event log keeps no password or signature of the URI
    frozen = freeze_records(records, origins, storage.folder("datasets") / "raw" / day,
                            source_label=f"partition {day}: source {shown}")
    context.log.info("partition %s: %d records from %s", day, frozen.records, shown)
    return dg.Output(
        RawPartition(path=str(frozen.path), records=frozen.records, digest=frozen.digest),
        # not `path`: the IO manager records the path of its pickle under that key
        metadata={"records": frozen.records, "digest": frozen.digest,
                  "dataset_path": dg.MetadataValue.path(str(frozen.folder))},
        data_version=dg.DataVersion(frozen.digest),
    )


class TrainingDatasetConfig(dg.Config):
    seq_len: int = Field(64, gt=0, description="tokens per packed training row")
    row_group_rows: int = Field(128, gt=0, description="rows per Parquet row group (the loader's unit)")
    rows_per_file: int = Field(1024, gt=0, description="rows per Parquet file")
    eval_fraction: float = Field(0.05, gt=0.0, lt=1.0, description="share of prompts held out for evaluation")
    max_eval_examples: int = Field(
        200, gt=0, description="held-out examples written for evaluation; the split's others are neither "
        "trained on nor scored (metadata held_out_examples counts them all)",
    )
    prompt_format: Literal["plain", "chat_template"] = Field(
        "plain", description="'plain': bos, then the prompt's text; 'chat_template': the prompt as a user turn in "
        "the base model tokenizer's chat template, as an instruct model sees it at inference (the template must end "
        "the assistant turn with the tokenizer's eos). Evaluation lays out held-out prompts the same way",
    )
    max_repeated_records: float = Field(
        MAX_REPEATED_RECORDS, ge=0.0, le=1.0, allow_inf_nan=False,
        description="no_duplicate_rows fails when more than this share of the day's records repeat an earlier "
        "one's tokens (a file exported twice repeats half); within it, duplicate packed rows those repeats "
        "explain pass",
    )


# What each of run_dataset_checks' checks verifies, shown with it in the UI.
DATASET_CHECK_DESCRIPTIONS = {
    "schema": "input_ids and labels are list<int32> columns and every row is seq_len tokens wide",
    "no_empty_rows": "there are training rows and each trains at least one token",
    "no_duplicate_rows": "no packed training row repeats another, except rows packed from source records that "
                         "repeat an earlier one's tokens, while those are at most max_repeated_records of the day's",
    "token_lengths": "packing fills the training rows: at least 50 % on average, the last row (what was left over) "
                     "not counted",
    "no_eval_leakage": "no held-out example (prompt + response tokens) is packed whole into a training row",
}


@dg.asset(
    partitions_def=DAILY,
    group_name="data",
    kinds={"parquet"},
    check_specs=[daily_blocking_check(name, "training_dataset", DATASET_CHECK_DESCRIPTIONS[name])
                 for name in DATASET_CHECK_NAMES],
)
def training_dataset(
    context: dg.AssetExecutionContext,
    config: TrainingDatasetConfig,
    storage: TesseraStorage,
    raw_examples: RawPartition,
    base_model: BaseModelRef,
):
    """Tokenized (base model's tokenizer), packed Parquet plus a held-out eval split, published
    atomically under datasets/training/<day>/<digest>. The content digest is the data version."""
    start_step(context)
    # Before any row is written: lora_adapter would refuse the rows only after they were cached and Ray started.
    check_context_length(base_model.name_or_path, config.seq_len)
    spec = DatasetSpec(**config.model_dump(exclude={"max_repeated_records"}))
    tokenizer = load_tokenizer(base_model.name_or_path)
    # The frozen records are read twice, each time as they come: memory holds a batch, not the day.
    dataset: PublishedDataset = write_dataset(
        iter_records(raw_examples.path),
        tokenizer,
        storage.folder("datasets") / "training" / context.partition_key,
        spec,
        source_label=f"partition {context.partition_key}",
        records_path=raw_examples.path,
        extra_manifest={"raw_digest": raw_examples.digest, "tokenizer": base_model.digest},
    )
    outcomes = run_dataset_checks(dataset.path, dataset.seq_len, tokenizer, iter_records(raw_examples.path),
                                  raw_examples.path, config.max_repeated_records)
    # Stored with the value: a consumer launched later on its own (row_group_cache, a training
    # window that includes this day) is not stopped by blocking checks, so it reads them here.
    dataset = replace(dataset, failed_checks=tuple(o.name for o in outcomes if not o.passed))
    if unused := dataset.held_out_examples - dataset.eval_examples:
        context.log.warning(f"{unused} of the {dataset.held_out_examples} held-out examples are neither trained on "
                            f"nor scored (max_eval_examples={config.max_eval_examples})")
    yield dg.Output(
        dataset,
        metadata={
            "dataset_path": dg.MetadataValue.path(dataset.path),
            "digest": dataset.digest,
            "train_rows": dataset.train_rows,
            "train_examples": dataset.train_examples,
            "eval_examples": dataset.eval_examples,
            "held_out_examples": dataset.held_out_examples,
            "row_groups": dataset.row_groups,
            "tokens": dataset.tokens,
            "prompt_format": dataset.prompt_format,
        },
        data_version=dg.DataVersion(dataset.digest),
    )
    # Blocking: a failed check stops row_group_cache and training for this partition in this run.
    for outcome in outcomes:
        yield dg.AssetCheckResult(check_name=outcome.name, passed=outcome.passed,
                                  description=outcome.description, metadata=outcome.metadata)


def refuse_days_that_failed_checks(failed: dict[str, tuple[str, ...]], consumer: str) -> None:
    """Raise naming each day whose stored training_dataset failed a blocking check (see ``failed_checks``)."""
    if failed:
        days = "; ".join(f"{day} failed {', '.join(checks)}" for day, checks in sorted(failed.items()))
        raise dg.Failure(
            f"{consumer} refuses training_dataset partition(s) whose blocking checks failed: {days}. Fix that "
            "day's source data and rematerialize raw_examples and training_dataset for it (training_dataset "
            "reads the copy raw_examples froze; its asset checks say what is wrong)"
        )
