"""MLflow bookkeeping on a real SQLite tracking store: batched logging keeps every value."""

from __future__ import annotations

from pathlib import Path

from training_core.tracking import MlflowTracking


def test_log_batch_records_every_param_metric_point_and_tag_beyond_mlflow_request_limits(tmp_path: Path):
    tracking = MlflowTracking(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    run_id = tracking.start_run("batched", tags={})
    # more than MLflow's 100 params/tags and 1 000 metrics per request, so it must split them
    params = {f"param_{i:03d}": f"value-{i}" for i in range(150)}
    curve = [(step, 1.0 / step) for step in range(1, 2501)]
    tracking.log_batch(run_id, params=params, metrics={"steps": 2500.0, "restarts": 1.0},
                       series={"train_loss": curve}, tags={"model_dir": "/models/x"})
    tracking.log_metrics(run_id, {"eval_loss": 0.25})

    run = tracking.client.get_run(run_id)
    assert run.data.params == params
    assert run.data.metrics == {"steps": 2500.0, "restarts": 1.0, "train_loss": 1.0 / 2500, "eval_loss": 0.25}
    assert run.data.tags["model_dir"] == "/models/x"
    assert tracking.loss_history(run_id) == curve
