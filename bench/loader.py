"""Loader benchmark: Tessera's RowGroupReader vs Petastorm, Ray Data and raw pyarrow.

``python -m bench.loader [--quick]`` (or ``make bench-loader``) writes bench/results/loader.json and
loader.png. Every configuration runs in a fresh subprocess (``--measure``), so peak RSS
(``ru_maxrss``) and allocator state belong to that configuration alone. Data lives in the
git-ignored bench/.data/; Petastorm runs in bench/.venv-petastorm, created on first use.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.slow_store import slow_filesystem

logger = logging.getLogger("bench.loader")

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
DATA_ROOT = BENCH_DIR / ".data"
PETASTORM_VENV = BENCH_DIR / ".venv-petastorm"
PETASTORM_PINS = ["pyarrow==14.0.2", "numpy<2", "setuptools<70"]
PETASTORM_DEPS = ["dill", "diskcache", "fsspec", "future", "packaging", "pandas<2.1", "psutil", "pyzmq", "six"]
BATCH_SIZE, TOKENS, ROW_GROUP_ROWS, FILES = 256, 256, 2000, 4
DEMAND_ROWS_PER_S = 128_000
SLOW_STORE = {"bandwidth_bytes_per_s": 50e6, "latency_s": 0.010}
CACHE_QUOTA = 8 * 2**30
# Tessera decodes with one thread per core: on this VM more decode threads than cores cost CPU
# (each thread's allocator heap faults in and purges its own fresh pages); 1/2/4 give the same order.
TESSERA_WORKERS = os.cpu_count() or 2
PETASTORM_WORKERS = (2, 4)
# Single-pass configurations (raw pyarrow, Tessera cold and without cache) are one short pass each:
# on this VM one pass moves by ±30 % with the host's memory state, so each runs this many times,
# alternating, each in a fresh subprocess (the cold one on a cleared cache), and the median is kept.
SINGLE_PASS_ROUNDS = 5
# The warm configurations whose figures are compared with each other (200 k vs 1 M rows) or with
# a threshold (the stall) alternate the same way, this many rounds, median kept.
WARM_ROUNDS = 3
# Cache policies on epochs over a dataset larger than the cache: the quota holds this fraction of
# the dataset's entries, and one reader runs this many reshuffled epochs per policy.
CACHE_POLICIES = ("evict", "stop_admitting")
POLICY_CACHE_FRACTION = 0.5
POLICY_EPOCHS = 5


def make_dataset(rows: int, directory: Path) -> Path:
    """``rows`` × (int64 id, 256 int32 tokens) in 4 files with 2 000-row groups; reused if present."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    spec = {"rows": rows, "files": FILES, "row_group_rows": ROW_GROUP_ROWS, "tokens": TOKENS, "seed": 0}
    marker = directory / "_spec.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return directory
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    per_file = rows // FILES
    for index in range(FILES):
        ids = np.arange(index * per_file, (index + 1) * per_file, dtype=np.int64)
        tokens = rng.integers(0, 32_000, (per_file, TOKENS), dtype=np.int32)
        column = pa.FixedSizeListArray.from_arrays(tokens.ravel(), TOKENS).cast(pa.list_(pa.int32()))
        pq.write_table(pa.table({"id": ids, "tokens": column}), directory / f"part-{index:05d}.parquet",
                       row_group_size=ROW_GROUP_ROWS)
    marker.write_text(json.dumps(spec))  # a _-prefixed side file: readers must ignore it
    return directory


# -- measurements (each runs in its own subprocess) -------------------------------------------------
def _peak_rss_mb() -> float:
    """``ru_maxrss`` of this process (Linux children inherit the parent's value at fork, so the
    parent keeps its own RSS small: it generates data in a subprocess too)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _vm_hwm_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def measure_dataset(rows: int, directory: str) -> dict:
    return {"path": str(make_dataset(rows, Path(directory)))}


def measure_tessera(data: str, cache_dir: str, passes: int = 1, warmup: int = 0, clear_cache: bool = False,
                    slow_store: bool = False, demand_rows_per_s: float | None = None,
                    workers: int = TESSERA_WORKERS,
                    use_cache: bool = True) -> dict:
    from training_core.data import CacheConfig, RowGroupReader

    if clear_cache:
        shutil.rmtree(cache_dir, ignore_errors=True)
    filesystem = slow_filesystem(**SLOW_STORE) if slow_store else None
    began = time.perf_counter()
    reader = RowGroupReader(data, batch_size=BATCH_SIZE, seed=0, workers=workers, filesystem=filesystem,
                            cache=CacheConfig(cache_dir, CACHE_QUOTA) if use_cache else None)
    open_s = time.perf_counter() - began
    rates, stalls, first_batch_s, first_wait_s, cpu_s = [], [], [], [], []
    for index in range(warmup + passes):
        rows, began, cpu_began = 0, time.perf_counter(), time.process_time()
        start_wait = reader.stats.consumer_wait_s
        for batch in reader:
            if not rows:
                first_batch_s.append(time.perf_counter() - began)
                first_wait_s.append(reader.stats.consumer_wait_s - start_wait)
            rows += len(batch["id"])
            if demand_rows_per_s:
                time.sleep(len(batch["id"]) / demand_rows_per_s)  # the "model" consuming the batch
        elapsed = time.perf_counter() - began
        if index >= warmup:
            cpu_s.append(time.process_time() - cpu_began)
            rates.append(rows / elapsed)
            stalls.append((reader.stats.consumer_wait_s - start_wait) / elapsed)
    stats = reader.stats.as_dict()
    reader.close()
    # stall once the first batch is there: (waited - first wait) / (elapsed - time to first batch)
    steady = [(stall * rows / rate - wait) / (rows / rate - first)
              for stall, rate, first, wait in zip(stalls, rates, first_batch_s[warmup:], first_wait_s[warmup:])]
    return {"rows_per_s": statistics.median(rates), "passes": rates, "stall_fraction": statistics.median(stalls),
            "stall_fraction_after_first_batch": statistics.median(steady),
            "time_to_first_batch_s": statistics.median(first_batch_s[warmup:]), "open_s": open_s,
            "cpu_s_per_pass": cpu_s,  # process CPU time: robust to other load on the machine
            "peak_rss_mb": _peak_rss_mb(), "vm_hwm_mb": _vm_hwm_mb(), "stats": stats}


def measure_raw(data: str) -> dict:
    """Single thread: every row group via ``ParquetFile.read_row_group`` → 2-D NumPy.

    One-time process costs stay out of the timing, as they do for Tessera: ``pyarrow.compute`` is
    imported first, and pyarrow's first ``to_numpy`` (which imports pandas, ~0.13 s; Tessera's
    conversion does not call it) runs once on a tiny array before the clock starts."""
    import pyarrow as pa
    import pyarrow.compute  # noqa: F401 - imported before timing, as Tessera's modules do
    import pyarrow.parquet as pq

    pa.array([0], pa.int32()).to_numpy(zero_copy_only=False)

    rows, began, cpu_began = 0, time.perf_counter(), time.process_time()
    for path in sorted(Path(data).glob("*.parquet")):
        parquet = pq.ParquetFile(path)
        for index in range(parquet.num_row_groups):
            table = parquet.read_row_group(index, use_threads=False)
            tokens = table.column("tokens").combine_chunks()
            matrix = tokens.flatten().to_numpy().reshape(len(tokens), TOKENS)
            ids = table.column("id").to_numpy()
            rows += len(ids) + 0 * matrix.shape[0]
    return {"rows_per_s": rows / (time.perf_counter() - began), "cpu_s": time.process_time() - cpu_began,
            "peak_rss_mb": _peak_rss_mb()}


def measure_ray(data: str, passes: int = 2) -> dict:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="error", object_store_memory=2 * 10**9)
    try:
        rates = []
        for _ in range(passes):
            rows, began = 0, time.perf_counter()
            for batch in ray.data.read_parquet(data).iter_batches(batch_size=BATCH_SIZE, batch_format="numpy"):
                rows += len(batch["id"])
            rates.append(rows / (time.perf_counter() - began))
    finally:
        ray.shutdown()
    return {"rows_per_s": max(rates), "passes": rates, "ray_version": ray.__version__}


def measure_order(data: str, cache_dir: str) -> dict:
    """Same id sequence for 1 vs 4 workers, without / cold / warm cache, on two layouts."""
    from training_core.data import CacheConfig, RowGroupReader

    def ids(workers: int, cache: bool, world_size: int = 1, rank: int = 0) -> np.ndarray:
        config = CacheConfig(cache_dir, CACHE_QUOTA) if cache else None
        with RowGroupReader(data, batch_size=BATCH_SIZE, seed=7, epoch=3, workers=workers, cache=config,
                            world_size=world_size, rank=rank, columns=["id"]) as reader:
            return np.concatenate([batch["id"] for batch in reader])

    shutil.rmtree(cache_dir, ignore_errors=True)
    checks = []
    for world_size, rank in [(1, 0), (3, 2)]:
        reference = ids(1, False, world_size, rank)
        others = [ids(4, False, world_size, rank), ids(4, True, world_size, rank), ids(2, True, world_size, rank)]
        checks.append(all(np.array_equal(reference, other) for other in others))
    return {"identical": all(checks)}


def measure_cache_policy(data: str, cache_dir: str, policy: str, cache_fraction: float, epochs: int) -> dict:
    """Epochs over a dataset larger than the cache: one reader, ``epochs`` passes (each reshuffled),
    the quota ``cache_fraction`` of what the whole dataset's entries take (found by warming a
    scratch cache first). Per epoch: hits, misses, bytes stored and evicted, rows/s, process CPU."""
    from training_core.data import CacheConfig, RowGroupReader, warm_cache
    from training_core.data.cache import RowGroupCache

    scratch = f"{cache_dir}-sizing"
    for folder in (cache_dir, scratch):
        shutil.rmtree(folder, ignore_errors=True)
    dataset_bytes = warm_cache(data, CacheConfig(scratch, CACHE_QUOTA), workers=TESSERA_WORKERS).bytes
    shutil.rmtree(scratch, ignore_errors=True)
    config = CacheConfig(cache_dir, int(cache_fraction * dataset_bytes), policy=policy)
    counters = ("cache_hits", "cache_misses", "cache_evictions", "cache_rejected", "cache_dropped")
    per_epoch = []
    with RowGroupReader(data, batch_size=BATCH_SIZE, seed=0, workers=TESSERA_WORKERS, cache=config) as reader:
        for _ in range(epochs):
            before = reader.stats.as_dict()
            rows, began, cpu_began = 0, time.perf_counter(), time.process_time()
            for batch in reader:  # the epoch's end stores every queued entry before it returns
                rows += len(batch["id"])
            elapsed, cpu_s = time.perf_counter() - began, time.process_time() - cpu_began
            after = reader.stats.as_dict()
            epoch = {name.removeprefix("cache_"): after[name] - before[name] for name in counters}
            epoch.update(rows_per_s=rows / elapsed, cpu_s=cpu_s,
                         hit_rate=epoch["hits"] / max(epoch["hits"] + epoch["misses"], 1))
            per_epoch.append(epoch)
    cache = RowGroupCache(config)
    try:
        volume = cache.volume()
    finally:
        cache.close()
    later = per_epoch[1:]  # the first epoch starts from an empty cache under either policy
    return {"policy": policy, "cache_fraction": cache_fraction, "dataset_bytes": dataset_bytes,
            "size_limit_bytes": config.size_limit_bytes, "volume_bytes_at_end": volume,
            "hit_rate_after_first_epoch": statistics.median(e["hit_rate"] for e in later),
            "rows_per_s_after_first_epoch": statistics.median(e["rows_per_s"] for e in later),
            "cpu_s_per_epoch_after_first": statistics.median(e["cpu_s"] for e in later),
            "evictions_per_epoch_after_first": statistics.median(e["evictions"] for e in later),
            "epochs": per_epoch}


def complete_cache(data: str, cache_dir: str) -> dict:
    """Store every row group a cold pass dropped (its writer queue was full), as the pipeline's
    ``row_group_cache`` asset does, so that warm rounds measure hits only."""
    from training_core.data import CacheConfig
    from training_core.data.cache import warm_cache

    return warm_cache(data, CacheConfig(cache_dir, CACHE_QUOTA), workers=TESSERA_WORKERS).as_dict()


def _median_run(runs: list[dict], key: str = "rows_per_s") -> dict:
    """The run with the median ``key``, with every run's rows/s, process CPU (and stall, peak RSS
    where measured) under ``runs``."""
    chosen = dict(sorted(runs, key=lambda run: run[key])[len(runs) // 2])
    chosen["runs"] = [{"rows_per_s": run["rows_per_s"],
                       "cpu_s": run.get("cpu_s", (run.get("cpu_s_per_pass") or [None])[0]),
                       **{name: run[name] for name in ("stall_fraction", "peak_rss_mb") if name in run}}
                      for run in runs]
    return chosen


def _median_round(runs: list[dict], key: str) -> dict:
    """The round with the median ``key``, every round's ``key`` under ``rounds``."""
    chosen = dict(sorted(runs, key=lambda run: run[key])[len(runs) // 2])
    chosen["rounds"] = [run[key] for run in runs]
    return chosen


MEASUREMENTS = {"tessera": measure_tessera, "raw": measure_raw, "ray": measure_ray, "order": measure_order,
                "dataset": measure_dataset, "cache_policy": measure_cache_policy, "complete_cache": complete_cache}


def _subprocess(name: str, timeout_s: float = 900, **kwargs: Any) -> dict:
    command = [sys.executable, "-m", "bench.loader", "--measure", name, "--kwargs", json.dumps(kwargs)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONWARNINGS": "ignore"})
    if done.returncode != 0:
        raise RuntimeError(f"benchmark step {name} {kwargs} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    logger.info("%s %s → %s", name, kwargs, {k: v for k, v in result.items() if k != "stats"})
    return result


def ensure_petastorm_venv() -> Path:
    """Create bench/.venv-petastorm (pyarrow 14, numpy<2, petastorm 0.13.1 without pyspark)."""
    python = PETASTORM_VENV / "bin" / "python"
    probe = [str(python), "-c", "import petastorm, pyarrow; assert petastorm.__version__ == '0.13.1'"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    shutil.rmtree(PETASTORM_VENV, ignore_errors=True)
    subprocess.run(["python3.11", "-m", "venv", str(PETASTORM_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run(pip + PETASTORM_PINS, check=True)
    subprocess.run(pip + ["--no-deps", "petastorm==0.13.1"], check=True)  # pyspark is not needed to read
    subprocess.run(pip + PETASTORM_DEPS + PETASTORM_PINS, check=True)
    subprocess.run(probe, check=True)
    return python


def measure_petastorm(data: Path, cache_dir: Path, passes: int) -> dict:
    """Petastorm at its best: thread pools of 2 and 4 workers, the faster warm result is kept."""
    python = ensure_petastorm_venv()
    results = []
    for workers in PETASTORM_WORKERS:
        shutil.rmtree(cache_dir, ignore_errors=True)
        done = subprocess.run(
            [str(python), "-W", "ignore", str(BENCH_DIR / "petastorm_baseline.py"), str(data), str(cache_dir),
             "--passes", str(passes), "--workers", str(workers)], capture_output=True, text=True, timeout=900,
            check=True,
        )
        result = {**json.loads(done.stdout.strip().splitlines()[-1]), "workers": workers}
        logger.info("petastorm → %s", result)
        results.append(result)
    best = max(results, key=lambda item: item["warm_rows_per_s"])
    return {**best, "fill_rows_per_s": max(item["fill_rows_per_s"] for item in results), "all": results}


def plot(rows_per_s: dict[str, float | None], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name, value in rows_per_s.items() if value]
    values = [rows_per_s[name] / 1e3 for name in names]
    figure, axis = plt.subplots(figsize=(10, 4.5))
    colors = ["tab:blue" if name.startswith("tessera") else "tab:gray" for name in names]
    bars = axis.bar(names, values, color=colors)
    axis.bar_label(bars, labels=[f"{v:,.0f}k" for v in values], fontsize=8)
    axis.set_ylabel("rows / s (thousands)")
    axis.set_title(f"Loader throughput, batch {BATCH_SIZE}, {TOKENS} int32 tokens/row (2 CPU cores)")
    axis.tick_params(axis="x", rotation=30)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run(output_dir: Path, quick: bool = False, petastorm: bool = True, data_root: Path = DATA_ROOT) -> dict:
    """Run every configuration; write ``loader.json`` and ``loader.png`` under ``output_dir``.
    ``petastorm=False`` skips the baseline (its venv is built on first use); datasets and caches
    go under ``data_root``."""
    rows = 40_000 if quick else 200_000
    passes = 1 if quick else 3
    output_dir.mkdir(parents=True, exist_ok=True)
    base = Path(_subprocess("dataset", rows=rows, directory=str(data_root / f"rows-{rows}"))["path"])
    large = Path(_subprocess("dataset", rows=5 * rows, directory=str(data_root / f"rows-{5 * rows}"))["path"])
    cache = str(data_root / "cache-local")
    slow_cache = str(data_root / "cache-slow")
    r: dict[str, dict] = {}
    rounds: dict[str, list[dict]] = {"pyarrow_raw": [], "tessera_cold": [], "tessera_no_cache": []}
    for _ in range(1 if quick else SINGLE_PASS_ROUNDS):  # alternate, so drifting load hits all three alike
        rounds["pyarrow_raw"].append(_subprocess("raw", data=str(base)))
        rounds["tessera_cold"].append(_subprocess("tessera", data=str(base), cache_dir=cache, clear_cache=True))
        rounds["tessera_no_cache"].append(_subprocess("tessera", data=str(base), cache_dir=cache, use_cache=False))
    r.update({name: _median_run(runs) for name, runs in rounds.items()})
    large_cache = str(data_root / "cache-5x")
    r["fill_5x"] = _subprocess("tessera", data=str(large), cache_dir=large_cache, clear_cache=True)
    # At 1 M rows the cold pass outruns its cache writer and drops entries (by design: decoding never
    # waits for the cache); a warm round would then store them in its untimed epoch, and its peak
    # RSS would be a fill's, not a warm read's.
    r["fill_5x_completion"] = _subprocess("complete_cache", data=str(large), cache_dir=large_cache)
    warm_rounds: dict[str, list[dict]] = {"tessera_warm": [], "tessera_warm_5x": [], "stall": []}
    for _ in range(1 if quick else WARM_ROUNDS):  # the cold rounds above left `cache` warm
        warm_rounds["tessera_warm"].append(
            _subprocess("tessera", data=str(base), cache_dir=cache, warmup=1, passes=passes))
        warm_rounds["tessera_warm_5x"].append(
            _subprocess("tessera", data=str(large), cache_dir=large_cache, warmup=1, passes=passes))
        warm_rounds["stall"].append(
            _subprocess("tessera", data=str(base), cache_dir=cache, demand_rows_per_s=DEMAND_ROWS_PER_S))
    r["tessera_warm"] = _median_run(warm_rounds["tessera_warm"])
    r["tessera_warm_5x"] = _median_run(warm_rounds["tessera_warm_5x"])
    r["stall"] = _median_run(warm_rounds["stall"], key="stall_fraction")
    policy_rounds: dict[str, list[dict]] = {policy: [] for policy in CACHE_POLICIES}
    for _ in range(1 if quick else WARM_ROUNDS):
        for policy in CACHE_POLICIES:
            policy_rounds[policy].append(_subprocess(
                "cache_policy", data=str(base), cache_dir=str(data_root / f"cache-policy-{policy}"), policy=policy,
                cache_fraction=POLICY_CACHE_FRACTION, epochs=POLICY_EPOCHS))
    r["cache_policies"] = {policy: _median_round(runs, "rows_per_s_after_first_epoch")
                           for policy, runs in policy_rounds.items()}
    r["tessera_slow_store_cold"] = _subprocess("tessera", data=str(base), cache_dir=slow_cache, clear_cache=True,
                                               slow_store=True)
    r["tessera_slow_store_warm"] = _subprocess("tessera", data=str(base), cache_dir=slow_cache, slow_store=True,
                                               warmup=1, passes=passes)
    r["order"] = _subprocess("order", data=str(base), cache_dir=str(data_root / "cache-order"))
    r["ray_data"] = _subprocess("ray", data=str(base), passes=2)
    if not petastorm:
        r["petastorm_warm"] = {"rows_per_s": None, "error": "skipped (--no-petastorm)"}
    else:
        try:
            r["petastorm_warm"] = measure_petastorm(base, data_root / "cache-petastorm", passes)
            r["petastorm_warm"]["rows_per_s"] = r["petastorm_warm"]["warm_rows_per_s"]
        except (subprocess.SubprocessError, OSError) as error:
            logger.error("petastorm baseline failed: %s", error)
            r["petastorm_warm"] = {"rows_per_s": None, "error": str(error)}
    names = ["tessera_cold", "tessera_no_cache", "tessera_warm", "petastorm_warm", "ray_data", "pyarrow_raw",
             "tessera_slow_store_cold", "tessera_slow_store_warm", "tessera_warm_5x"]
    rates = {name: r[name]["rows_per_s"] for name in names}
    ratio = lambda a, b: (rates[a] / rates[b]) if rates.get(a) and rates.get(b) else None  # noqa: E731
    result = {
        "rows_per_s": rates,
        # the highest of the warm rounds: a bound is only shown by the worst run
        "peak_rss_mb": {f"{rows // 1000}k" if rows < 10**6 else f"{rows // 10**6}m":
                        max(run["peak_rss_mb"] for run in warm_rounds["tessera_warm"]),
                        f"{5 * rows // 1000}k" if 5 * rows < 10**6 else f"{5 * rows // 10**6}m":
                        max(run["peak_rss_mb"] for run in warm_rounds["tessera_warm_5x"])},
        "stall_fraction": r["stall"]["stall_fraction"],
        "stall_detail": {key: r["stall"][key] for key in ("stall_fraction_after_first_batch", "time_to_first_batch_s")},
        # every cold run must fill the cache completely: its misses were all stored, none dropped
        "cold_cache_fill": {key: max(run["stats"][key] for run in rounds["tessera_cold"])
                            for key in ("cache_misses", "cache_dropped")},
        # warm rounds, untimed first epoch included, must read hits only (0 misses)
        "warm_round_cache_misses": {name: max(run["stats"]["cache_misses"] for run in warm_rounds[name])
                                    for name in ("tessera_warm", "tessera_warm_5x", "stall")},
        "order_identical_across_workers": r["order"]["identical"],
        # epochs over a dataset twice the cache's quota: what each policy gets after the first epoch
        "cache_policies": {policy: {
            **{key: run[key] for key in ("hit_rate_after_first_epoch", "rows_per_s_after_first_epoch",
                                         "cpu_s_per_epoch_after_first", "evictions_per_epoch_after_first")},
            "quota_respected": all(each["volume_bytes_at_end"] <= each["size_limit_bytes"]
                                   for each in policy_rounds[policy]),
        } for policy, run in r["cache_policies"].items()},
        "ratios": {
            "warm_vs_petastorm_warm": ratio("tessera_warm", "petastorm_warm"),
            "warm_vs_petastorm_fill": (rates["tessera_warm"] / r["petastorm_warm"]["fill_rows_per_s"]
                                       if r["petastorm_warm"].get("fill_rows_per_s") else None),
            "no_cache_vs_pyarrow_raw": ratio("tessera_no_cache", "pyarrow_raw"),
            "cold_vs_pyarrow_raw": ratio("tessera_cold", "pyarrow_raw"),
            "cold_vs_pyarrow_raw_per_round": [cold["rows_per_s"] / raw["rows_per_s"] for cold, raw in
                                              zip(rounds["tessera_cold"], rounds["pyarrow_raw"])],
            "cold_vs_ray_data": ratio("tessera_cold", "ray_data"),
            "slow_store_warm_vs_cold": ratio("tessera_slow_store_warm", "tessera_slow_store_cold"),
            "warm_5x_vs_warm": ratio("tessera_warm_5x", "tessera_warm"),
        },
        "setup": {"rows": rows, "rows_5x": 5 * rows, "files": FILES, "row_group_rows": ROW_GROUP_ROWS,
                  "tokens": TOKENS, "batch_size": BATCH_SIZE, "workers": TESSERA_WORKERS,
                  "petastorm_workers": list(PETASTORM_WORKERS), "warm_passes": passes,
                  "single_pass_rounds": len(rounds["tessera_cold"]), "warm_rounds": len(warm_rounds["stall"]),
                  "demand_rows_per_s": DEMAND_ROWS_PER_S, "policy_cache_fraction": POLICY_CACHE_FRACTION,
                  "policy_epochs": POLICY_EPOCHS, "slow_store": SLOW_STORE, "cpus": os.cpu_count(),
                  "quick": quick},
        "details": r,
    }
    (output_dir / "loader.json").write_text(json.dumps(result, indent=2, default=float))
    plot(rates, output_dir / "loader.png")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="40k rows, one timed pass (smoke test)")
    parser.add_argument("--output-dir", type=Path, default=None,
                        help="default bench/results, or bench/results/quick (git-ignored) with --quick, so that a "
                             "smoke run never replaces the recorded results")
    parser.add_argument("--no-petastorm", action="store_true",
                        help="skip the Petastorm 0.13.1 baseline (its own venv is built on first use)")
    parser.add_argument("--measure", choices=sorted(MEASUREMENTS), help=argparse.SUPPRESS)
    parser.add_argument("--kwargs", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(MEASUREMENTS[args.measure](**json.loads(args.kwargs)), default=float))  # for the parent
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    output_dir = args.output_dir or BENCH_DIR / "results" / ("quick" if args.quick else "")
    result = run(output_dir, quick=args.quick, petastorm=not args.no_petastorm)
    print(json.dumps({key: result[key] for key in ("rows_per_s", "peak_rss_mb", "stall_fraction",
                                                   "order_identical_across_workers", "ratios")}, indent=2))


if __name__ == "__main__":
    main()
