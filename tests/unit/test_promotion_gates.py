"""Promotion's decisions: the gates' limits, a promotion launched on its own, a champion that moved,
could not be scored, or is of a later day than the candidate (real MLflow registry, sqlite store)."""

from __future__ import annotations

import dagster as dg
import pytest

from assets.evaluation_assets import (
    CHAMPION_ALIAS,
    REGISTERED_MODEL,
    PromotionConfig,
    _beats_base_model,
    _not_worse_than_champion,
    promoted_model,
)
from resources import MlflowTracker, TesseraStorage
from training_core.evaluate.compare import CHAMPION_UNRECORDED, EvaluationReport
from training_core.evaluate.results import EvalMetrics
from training_core.registry import ModelRegistry
from training_core.tracking import MlflowTracking


def _trained_run(tracking: MlflowTracking, folder, name: str, params: dict[str, str] | None = None) -> str:
    """A finished MLflow run with a PEFT adapter's files as its `model` artifacts (only their names matter)."""
    run_id = tracking.start_run(name, tags={})
    if params:
        tracking.log_batch(run_id, params=params)
    model = folder / run_id / "model"
    model.mkdir(parents=True)
    (model / "adapter_config.json").write_text("{}")
    tracking.client.log_artifacts(run_id, str(model), "model")
    tracking.end_run(run_id)
    return run_id


def _report(trained_loss: float, champion_loss: float | None = None) -> EvaluationReport:
    def metrics(loss):
        return EvalMetrics(loss=loss, perplexity=2.0, exact_match=0.0, examples=4)

    return EvaluationReport(metrics(2.0), metrics(trained_loss), "model", "run",
                            metrics(champion_loss) if champion_loss is not None else None)


def test_the_gates_use_the_configured_limits():
    report = _report(trained_loss=1.9, champion_loss=1.7)  # ratio 0.95; 11.8 % above the champion
    assert _beats_base_model(report, max_loss_ratio=1.0).passed is True
    assert _beats_base_model(report, max_loss_ratio=0.9).passed is False
    assert _not_worse_than_champion(report, "champ", champion_tolerance=0.05).passed is False
    assert _not_worse_than_champion(report, "champ", champion_tolerance=0.2).passed is True


def test_a_champion_near_zero_loss_is_matched_within_a_hundredth_of_a_nat():
    # The demo's days: both models memorize the task; 5 % of 0.0055 would fail a model at 0.0062.
    assert _not_worse_than_champion(_report(trained_loss=0.0062, champion_loss=0.0055), "champ",
                                    champion_tolerance=0.05).passed is True
    assert _not_worse_than_champion(_report(trained_loss=0.0160, champion_loss=0.0055), "champ",
                                    champion_tolerance=0.05).passed is False
    assert _not_worse_than_champion(_report(trained_loss=0.0056, champion_loss=0.0055), "champ",
                                    champion_tolerance=0.0).passed is False  # 0: strict
    assert _not_worse_than_champion(_report(trained_loss=0.0055, champion_loss=0.0055), "champ",
                                    champion_tolerance=0.0).passed is True  # 0: no higher, an equal loss passes


def test_a_champion_whose_loss_is_not_finite_is_not_compared():
    check = _not_worse_than_champion(_report(trained_loss=1.9, champion_loss=float("nan")), "champ",
                                     champion_tolerance=0.05)
    assert check.passed is True and check.metadata["compared"].value is False
    assert check.description.startswith("not compared: the champion scores a held-out loss of nan on these records")


class _UnreachableTracker:
    """Promotion must refuse before it looks at the registry."""

    def client(self):
        raise AssertionError("the registry was consulted for a promotion its gates refuse")


@pytest.mark.parametrize("failed_gates, champion_run_id, named", [
    (("not_worse_than_champion",), "champ", "failed not_worse_than_champion"),
    (None, "champ", "carries no gate results"),
    ((), CHAMPION_UNRECORDED, "does not record which champion it was compared with"),
])
def test_a_promotion_launched_on_its_own_refuses_an_evaluation_whose_gates_failed(failed_gates, champion_run_id,
                                                                                 named):
    # In the evaluating run, blocking checks skip promoted_model; launched later by itself it must
    # read the verdict off the evaluation instead of moving the champion.
    from dataclasses import replace

    report = replace(_report(trained_loss=1.9, champion_loss=1.7), failed_gates=failed_gates,
                     champion_run_id=champion_run_id)
    context = dg.build_asset_context(partition_key="2026-11-01")
    with pytest.raises(dg.Failure, match=named) as refused:
        promoted_model(context, mlflow_tracker=_UnreachableTracker(), evaluation=report)
    assert "2026-11-01" in str(refused.value) and "champion stays where it is" in str(refused.value)


def test_promotion_refuses_when_the_champion_moved_since_the_evaluation_compared_with_it(tmp_path):
    # Two days of a backfill evaluated in parallel against the same champion: the first to promote
    # moves the alias; the second was never compared with that model, so it must not replace it.
    from dataclasses import replace

    tracking = (mlflow_tracker := MlflowTracker(storage=TesseraStorage(home=str(tmp_path / "home")))).client()
    registry = ModelRegistry(tracking, REGISTERED_MODEL, CHAMPION_ALIAS)
    runs = {name: _trained_run(tracking, tmp_path, name) for name in ("day-1", "day-2", "day-3")}

    def promote(run: str, compared_with: str | None):
        report = replace(_report(trained_loss=1.0), mlflow_run_id=runs[run], failed_gates=(),
                         champion_run_id=runs.get(compared_with))
        return promoted_model(dg.build_asset_context(partition_key="2026-11-02"), mlflow_tracker=mlflow_tracker,
                              evaluation=report).value

    assert promote("day-1", compared_with=None).run_id == runs["day-1"]  # no champion yet, none then
    with pytest.raises(dg.Failure) as refused:  # day-2 was evaluated before day-1 became champion
        promote("day-2", compared_with=None)
    assert str(refused.value) == (
        f"not promoting MLflow run {runs['day-2']}: the evaluation of partition 2026-11-02 compared it with no champion "
        f"(there was none yet), but champion is now {REGISTERED_MODEL} version 1 (MLflow run {runs['day-1']}); "
        "rematerialize evaluation for this partition, then promoted_model, to compare with the current champion; "
        "champion stays where it is")
    assert registry.champion().run_id == runs["day-1"]

    assert promote("day-3", compared_with="day-1").run_id == runs["day-3"]  # compared with the champion: moves
    with pytest.raises(dg.Failure, match=f"compared it with champion run {runs['day-1']}, but champion is now "):
        promote("day-2", compared_with="day-1")
    assert registry.champion().run_id == runs["day-3"]
    assert promote("day-3", compared_with="day-1").run_id == runs["day-3"]  # promoting the champion again: no-op
    assert str(registry.champion().version) == "2"


def test_a_champion_that_cannot_be_compared_passes_the_gate_saying_why():
    check = _not_worse_than_champion(_report(trained_loss=9.0), "champ", champion_tolerance=0.05,
                                     not_comparable="the champion was trained on X, whose tokenizer differs")
    assert check.passed is True
    assert check.description == "not compared: the champion was trained on X, whose tokenizer differs"
    assert check.metadata["compared"].value is False


@pytest.mark.parametrize(("champion_loss", "alias_moved"), [(float("nan"), True), (1.5, False)])
def test_an_earlier_day_replaces_only_a_champion_evaluation_could_not_score(tmp_path, champion_loss, alias_moved):
    # The gate said a model that passes the other gate replaces an unscorable champion: promotion does, whatever its day.
    tracker = MlflowTracker(storage=TesseraStorage(home=str(tmp_path / "home")))
    tracking = tracker.client()
    champion, candidate = (_trained_run(tracking, tmp_path, f"train-{day}", {"partition_keys": day})
                           for day in ("2026-11-05", "2026-11-03"))
    ModelRegistry(tracking, REGISTERED_MODEL, CHAMPION_ALIAS).promote(champion)
    scores = EvaluationReport(EvalMetrics(2.0, 7.4, 0.0, 4), EvalMetrics(1.0, 2.7, 0.0, 4), "/trained", candidate,
                              champion=EvalMetrics(champion_loss, 4.5, 0.0, 4), failed_gates=(),
                              champion_run_id=champion)
    promotion = promoted_model(dg.build_asset_context(partition_key="2026-11-03"), config=PromotionConfig(),
                               mlflow_tracker=tracker, evaluation=scores)
    assert promotion.metadata["alias_moved"].value is alias_moved
    assert promotion.value.run_id == (candidate if alias_moved else champion)


@pytest.mark.parametrize(("champion_days", "candidate_day", "allow_older_day", "alias_moved"), [
    ("2026-11-05", "2026-11-05", False, True),              # another run of the champion's own day replaces it
    ("2026-11-04,2026-11-05", "2026-11-04", False, False),  # a champion's day is its window's last day
    ("2026-11-05", "2026-11-03", True, True),               # the operator's roll-back
])
def test_the_champions_day_decides_which_days_may_replace_it(tmp_path, champion_days, candidate_day,
                                                             allow_older_day, alias_moved):
    tracker = MlflowTracker(storage=TesseraStorage(home=str(tmp_path / "home")))
    tracking = tracker.client()
    champion = _trained_run(tracking, tmp_path, "champion", {"partition_keys": champion_days})
    candidate = _trained_run(tracking, tmp_path, "candidate", {"partition_keys": candidate_day})
    ModelRegistry(tracking, REGISTERED_MODEL, CHAMPION_ALIAS).promote(champion)
    scores = EvaluationReport(EvalMetrics(2.0, 7.4, 0.0, 4), EvalMetrics(1.0, 2.7, 0.0, 4), "/trained", candidate,
                              champion=EvalMetrics(1.5, 4.5, 0.0, 4), failed_gates=(), champion_run_id=champion)
    promotion = promoted_model(dg.build_asset_context(partition_key=candidate_day),
                               config=PromotionConfig(allow_older_day=allow_older_day), mlflow_tracker=tracker,
                               evaluation=scores)
    assert promotion.value.run_id == (candidate if alias_moved else champion)
