"""Petastorm 0.13.1 baseline, run by bench/loader.py inside bench/.venv-petastorm (pyarrow 14, numpy<2).

Reads the benchmark dataset with ``make_batch_reader`` and a local-disk cache: one pass fills the
cache, then ``--passes`` timed passes read from it. Prints one JSON object on stdout.
Usage: python bench/petastorm_baseline.py DATA_DIR CACHE_DIR [--passes 3] [--workers 4]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import time


def one_pass(url: str, cache_dir: str, workers: int) -> tuple[int, float]:
    from petastorm import make_batch_reader

    began = time.perf_counter()
    rows = 0
    with make_batch_reader(
        url, reader_pool_type="thread", workers_count=workers, num_epochs=1, shuffle_row_groups=True, seed=0,
        cache_type="local-disk", cache_location=cache_dir, cache_size_limit=8 * 2**30,
        cache_row_size_estimate=1100, cache_extra_settings={"cleanup": False},  # else __exit__ deletes it
    ) as reader:
        for batch in reader:
            rows += len(batch.id)
    return rows, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data_dir")
    parser.add_argument("cache_dir")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    import petastorm

    url = "file://" + args.data_dir
    fill_rows, fill_s = one_pass(url, args.cache_dir, args.workers)
    rates = []
    for _ in range(args.passes):
        rows, seconds = one_pass(url, args.cache_dir, args.workers)
        assert rows == fill_rows, (rows, fill_rows)
        rates.append(rows / seconds)
    print(json.dumps({
        "petastorm_version": petastorm.__version__,
        "rows": fill_rows,
        "fill_rows_per_s": fill_rows / fill_s,
        "warm_rows_per_s": statistics.median(rates),
        "warm_passes": rates,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }))


if __name__ == "__main__":
    main()
