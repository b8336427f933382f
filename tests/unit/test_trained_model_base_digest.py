"""A TrainedModel the io manager pickled before it carried its base model's digest still loads, and
evaluation still refuses it over another base: it reads the digest off the run's lineage record."""

from __future__ import annotations

import pickle

import pytest

from assets.evaluation_assets import _refuse_another_base_model
from assets.training_assets import TrainedModel
from training_core.base_model import BaseModelRef
from training_core.errors import LineageError
from training_core.tracking import MlflowTracking

TRAINED_ON, OTHER = "a" * 64, "b" * 64


def _base(digest: str) -> BaseModelRef:
    return BaseModelRef(f"/models/base/tiny-llama-{digest[:16]}", digest, parameters=1, vocab_size=None, source="demo")


def _stored_before_the_digest_was(trained: TrainedModel) -> TrainedModel:
    """What unpickling a value written by the earlier TrainedModel (no base_model_digest field) gives."""
    trained.__dict__.pop("base_model_digest")
    return pickle.loads(pickle.dumps(trained))


@pytest.fixture
def tracking(tmp_path):
    return MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")


def test_an_older_pickled_trained_model_loads_and_is_checked_against_its_runs_lineage(tracking):
    run_id = tracking.start_run("trained", tags={})
    tracking.log_batch(run_id, params={"base_model_digest": TRAINED_ON})
    old = _stored_before_the_digest_was(
        TrainedModel("/models/trained/x", "lora", run_id, _base(TRAINED_ON).name_or_path, "d" * 64, 1.0,
                     base_model_digest=TRAINED_ON))
    assert old.base_model_digest == ""  # unrecorded

    _refuse_another_base_model(old, _base(TRAINED_ON), tracking, "2026-11-01")  # the same base: evaluated
    with pytest.raises(LineageError) as refused:
        _refuse_another_base_model(old, _base(OTHER), tracking, "2026-11-01")
    assert str(refused.value) == (
        f"lora_adapter of partition 2026-11-01 (MLflow run {run_id}) was trained on base model "
        f"/models/base/tiny-llama-{'a' * 16} (digest {'a' * 12}), but base_model is now "
        f"/models/base/tiny-llama-{'b' * 16} (digest {'b' * 12}); rematerialize lora_adapter for partition "
        "2026-11-01 to train on it (nothing was evaluated or logged)")


def test_the_digest_carried_by_the_trained_model_decides(tracking):
    run_id = tracking.start_run("trained", tags={})  # its run records nothing: the value's own digest is used
    trained = TrainedModel("/models/trained/x", "lora", run_id, _base(TRAINED_ON).name_or_path, "d" * 64, 1.0,
                           base_model_digest=TRAINED_ON)
    with pytest.raises(LineageError, match="rematerialize lora_adapter for partition 2026-11-01"):
        _refuse_another_base_model(trained, _base(OTHER), tracking, "2026-11-01")
    _refuse_another_base_model(trained, _base(TRAINED_ON), tracking, "2026-11-01")


def test_an_older_pickled_trained_model_loads_through_the_io_manager(tmp_path):
    # Refused as stale, it forced a retrain of every day stored before the upgrade.
    import dagster as dg

    from resources.io_manager import AtomicFilesystemIOManager

    @dg.asset
    def lora_adapter() -> TrainedModel:
        raise AssertionError("stored below, not materialized")

    @dg.asset
    def reads_it(lora_adapter: TrainedModel) -> str:
        return lora_adapter.base_model_digest

    old = _stored_before_the_digest_was(
        TrainedModel("/models/trained/x", "lora", "run", "/models/base/x", "d" * 64, 1.0, base_model_digest="a"))
    (tmp_path / "lora_adapter").write_bytes(pickle.dumps(old))
    with dg.instance_for_test() as instance:
        result = dg.materialize([lora_adapter, reads_it], selection=[reads_it], instance=instance,
                                resources={"io_manager": AtomicFilesystemIOManager(base_dir=str(tmp_path))})
    assert result.output_for_node("reads_it") == ""  # unrecorded: evaluation reads the run's lineage
