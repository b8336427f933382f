"""`tessera bench loader --quick`: the benchmark's own code runs and writes the result it promises.
No figure is asserted (speed belongs in the benchmark's results, not in tests); the structure and
the correctness checks the benchmark makes are."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def test_the_loader_benchmark_runs_and_writes_its_json_and_chart(tmp_path):
    from bench import loader

    result = loader.run(tmp_path / "results", quick=True, petastorm=False, data_root=tmp_path / "data")
    written = json.loads((tmp_path / "results" / "loader.json").read_text())
    assert written["rows_per_s"] == pytest.approx(result["rows_per_s"])
    assert (tmp_path / "results" / "loader.png").stat().st_size > 0
    rates = written["rows_per_s"]
    assert set(rates) == {"tessera_cold", "tessera_no_cache", "tessera_warm", "petastorm_warm", "ray_data",
                          "pyarrow_raw", "tessera_slow_store_cold", "tessera_slow_store_warm", "tessera_warm_5x"}
    assert rates["petastorm_warm"] is None and written["details"]["petastorm_warm"]["error"].startswith("skipped")
    assert all(rate > 0 for name, rate in rates.items() if name != "petastorm_warm")
    assert set(written["peak_rss_mb"]) == {"40k", "200k"}  # quick: 40 000 rows and 5x
    assert 0.0 <= written["stall_fraction"] < 1.0
    assert written["order_identical_across_workers"] is True
    assert written["cold_cache_fill"]["cache_dropped"] == 0
    assert written["warm_round_cache_misses"] == {"tessera_warm": 0, "tessera_warm_5x": 0, "stall": 0}
    for policy in ("evict", "stop_admitting"):
        assert written["cache_policies"][policy]["quota_respected"] is True
