"""What a worker compares against: the identity the driver's lineage record gives (its versions and
environment digest as recorded, not the worker's own), and every package on either side."""

from __future__ import annotations

import pytest

from training_core.errors import LineageError
from training_core.lineage import build_lineage_record, environment_digest, package_versions
from training_core.train.worker_code import CodeIdentity, refuse_other_code


def _lineage() -> dict[str, str]:
    return build_lineage_record(
        seed=0, data_seed=0, dataset_digest="d", dataset_paths=[], cache_version="c", base_model="m",
        base_model_digest="b", config_digest="x", dagster_run_id="", partition_keys=[])


def test_a_lineage_recording_other_libraries_is_refused_naming_each_package_and_its_digest():
    """The driver ran other torch and bitsandbytes versions than this worker has (a CPU image has no bitsandbytes)."""
    lineage = _lineage() | {"version_torch": "2.0.0", "version_bitsandbytes": "0.42.0",
                            "environment_digest": "f" * 16}
    recorded = CodeIdentity.from_lineage(lineage)
    assert recorded.package_versions["version_torch"] == "2.0.0" and recorded.environment_digest == "f" * 16

    with pytest.raises(LineageError) as refused:
        refuse_other_code(recorded, rank=0)
    message, here = str(refused.value), package_versions()
    assert f"version_torch: 2.0.0 (recorded) ≠ {here['version_torch']} (this worker)" in message
    assert f"version_bitsandbytes: 0.42.0 (recorded) ≠ {here['version_bitsandbytes']} (this worker)" in message
    assert "version_numpy" not in message and "code:" not in message
    assert f"environment_digest {'f' * 16} (recorded) vs {environment_digest(here)} (this worker)" in message


def test_a_package_recorded_but_unknown_to_the_worker_is_refused():
    """A package the driver tracked that the worker's identity does not name at all is a difference."""
    recorded = CodeIdentity("a" * 40, "1" * 12, {"version_torch": "2.5.1", "version_bitsandbytes": "0.45.0"}, "e" * 16)
    running = CodeIdentity("a" * 40, "1" * 12, {"version_torch": "2.5.1"}, "f" * 16)
    with pytest.raises(LineageError, match=r"version_bitsandbytes: 0\.45\.0 \(recorded\) ≠ not recorded \(this worker\)"):
        refuse_other_code(recorded, rank=0, running=running)
