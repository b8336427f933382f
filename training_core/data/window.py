"""A training window: the published datasets of several data partitions, trained on together."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from training_core.data.batch_columns import TRAINING_COLUMNS, TRAINING_TRANSFORM_VERSION
from training_core.data.cache import cache_version
from training_core.data.dataset_writer import PublishedDataset, read_eval_records
from training_core.data.packing import EVAL_SPLIT_METHOD


def window_digest(digests: list[str]) -> str:
    """One partition: its own digest. Several: a digest of their digests, in window order."""
    if len(digests) == 1:
        return digests[0]
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()


@dataclass(frozen=True)
class DatasetWindow:
    partition_keys: list[str]
    datasets: list[PublishedDataset]

    @classmethod
    def from_partitions(cls, by_partition: dict[str, PublishedDataset]) -> "DatasetWindow":
        if not by_partition:
            raise ValueError("the training window holds no materialized partition")
        keys = sorted(by_partition)
        seq_lens = {by_partition[k].seq_len for k in keys}
        if len(seq_lens) != 1:
            raise ValueError(f"partitions {keys} were packed with different seq_len {sorted(seq_lens)}; "
                             "rematerialize training_dataset for them with one seq_len")
        _refuse_mixed_eval_splits({k: by_partition[k].eval_split() for k in keys})
        formats = {k: by_partition[k].prompt_format for k in keys}
        if len(set(formats.values())) > 1:
            days = ", ".join(f"{key} (prompt_format={prompt_format})" for key, prompt_format in formats.items())
            raise ValueError(f"partitions {days} laid out their prompts differently, so the model would learn two "
                             "prompt layouts and be scored on one; rematerialize training_dataset for them with one "
                             "prompt_format")
        return cls(keys, [by_partition[k] for k in keys])

    @property
    def digest(self) -> str:
        return window_digest([d.digest for d in self.datasets])

    @property
    def paths(self) -> list[str]:
        return [d.path for d in self.datasets]

    @property
    def seq_len(self) -> int:
        return self.datasets[0].seq_len

    @property
    def prompt_format(self) -> str:
        """How every day laid out its prompts (one format: from_partitions refuses a mix); evaluation
        tokenizes the held-out records the same way."""
        return self.datasets[0].prompt_format

    def eval_records(self) -> list[dict[str, str]]:
        return eval_records(self.paths)

    def failed_checks(self) -> dict[str, tuple[str, ...]]:
        """Days whose dataset failed a blocking quality check, with the checks' names."""
        return {key: d.failed_checks for key, d in zip(self.partition_keys, self.datasets) if d.failed_checks}

    def stale_caches(self, cache_versions: dict[str, str]) -> list[str]:
        """Days whose warmed cache version is not the one of their current dataset: the cache was
        warmed for an earlier materialization of that day (training would record a version that
        no reproduction can rebuild)."""
        return [key for key, d in zip(self.partition_keys, self.datasets)
                if cache_versions.get(key) != cache_version(d.digest, TRAINING_COLUMNS, TRAINING_TRANSFORM_VERSION)]


def _refuse_mixed_eval_splits(splits: dict[str, tuple[str, float] | None]) -> None:
    """The split is a pure function of (prompt, method, eval_fraction): with another method or
    fraction on another day, a prompt held out (and scored) on one day is trained on from the other.
    A day whose split nothing records (no manifest left) is not compared: training refuses it for
    that missing manifest."""
    known = {key: split for key, split in splits.items() if split is not None}
    if len({method for method, _ in known.values()}) > 1:
        stale = [key for key, (method, _) in known.items() if method != EVAL_SPLIT_METHOD] or list(known)
        days = ", ".join(f"{key} (split by {method})" for key, (method, _) in known.items())
        raise ValueError(f"partitions {days} were split by different methods (this version splits by "
                         f"{EVAL_SPLIT_METHOD}), so prompts held out on one day are trained on from another; "
                         f"rematerialize training_dataset for {', '.join(stale)}")
    if len({fraction for _, fraction in known.values()}) > 1:
        days = ", ".join(f"{key} (eval_fraction={fraction})" for key, (_, fraction) in known.items())
        raise ValueError(f"partitions {days} were split with different eval_fraction, so prompts held out on one "
                         "day are trained on from another; rematerialize training_dataset for them with one "
                         "eval_fraction")


def eval_records(dataset_paths: list[str]) -> list[dict[str, str]]:
    """The held-out prompts of every dataset in a training window, in window order."""
    return [record for path in dataset_paths for record in read_eval_records(path)]
