"""A day Dagster added to an asset backfill beyond its range (assets/backfills.py), seen through the UI.

lora_adapter ends without output, the reason a warning in the run, and evaluation and promoted_model
are skipped: the day keeps its earlier materializations, its gates record no verdict (shown skipped),
and the backfill ends failed listing the day. Re-executing skips it again: the run's "Re-execute" (a
new run carrying only parent and root run ids once the backfill has finished) and the backfill page's "Re-execute" (a new backfill over what
did not materialize, which no longer holds the range's data). Dagster's own GraphQL mutations and
backfill daemon iteration on an in-process code location; runs execute in this process and are
skipped before any work, so nothing trains."""

from __future__ import annotations

import logging
import time

import dagster as dg
import pytest
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)
from dagster._core.definitions.assets.graph.asset_graph_subset import AssetGraphSubset
from dagster._core.definitions.events import AssetKeyPartitionKey
from dagster._core.execution.asset_backfill import AssetBackfillData
from dagster._core.execution.backfill import BulkActionStatus, PartitionBackfill
from dagster._core.remote_origin import InProcessCodeLocationOrigin
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._core.workspace.context import WorkspaceProcessContext
from dagster._core.workspace.load_target import InProcessWorkspaceLoadTarget
from dagster._daemon.backfill import execute_backfill_iteration
from dagster_graphql.test.utils import execute_dagster_graphql

from pipelines.graph import ASSETS
from pipelines.resources_local import local_resources
from tests.unit.test_backfill_window_spill import _NeverMaterializedInputs

RANGE = ["2026-11-02", "2026-11-03"]
AFTER_RANGE = "2026-11-04"
DATA = ["raw_examples", "training_dataset", "row_group_cache", "base_model"]
TRAINING = ["lora_adapter", "evaluation", "promoted_model"]
GATES = ["evaluation:beats_base_model", "evaluation:not_worse_than_champion"]
SKIPPED = f"not running {AFTER_RANGE}: Dagster added day {AFTER_RANGE} to backfill wholegraph because"

LAUNCH_RUN = """mutation($params: ExecutionParams!) { launchPipelineExecution(executionParams: $params) {
  __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } } }"""
REEXECUTE_RUN = """mutation($params: ReexecutionParams!) { launchRunReexecution(reexecutionParams: $params) {
  __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } } }"""
REEXECUTE_BACKFILL = """mutation($params: ReexecutionParams!) { reexecutePartitionBackfill(reexecutionParams: $params) {
  __typename ... on LaunchBackfillSuccess { backfillId } ... on PythonError { message } } }"""
STATUSES = """query { assetNodes { assetKey { path }
  assetPartitionStatuses { ... on TimePartitionStatuses { ranges { status startKey endKey } } }
  assetChecksOrError { ... on AssetChecks { checks { name
    partitionStatuses { ... on AssetCheckTimePartitionStatuses { ranges { status startKey endKey } } } } } } } }"""


# The code location the workspace loads (state under $TESSERA_HOME, set per test).
skipping_location = dg.Definitions(
    assets=ASSETS, resources={**local_resources(), "io_manager": _NeverMaterializedInputs()},
    executor=dg.in_process_executor,
)


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path / "state"))
    launch_now = {  # runs execute synchronously in this process once launched
        "run_coordinator": {"module": "dagster._core.run_coordinator", "class": "DefaultRunCoordinator"},
        "run_launcher": {"module": "dagster._core.launcher.sync_in_memory_run_launcher",
                         "class": "SyncInMemoryRunLauncher"},
    }
    origin = InProcessCodeLocationOrigin(LoadableTargetOrigin(module_name=__name__, attribute="skipping_location"))
    with dg.instance_for_test(overrides=launch_now) as instance:
        with WorkspaceProcessContext(instance, InProcessWorkspaceLoadTarget(origin)) as process:
            yield process
    assert not (tmp_path / "state").exists()  # no model, Ray run, MLflow store or download


def _finished_whole_graph_backfill(process: WorkspaceProcessContext, built: dict[str, list[str]],
                                   selection: list[str] = DATA + TRAINING) -> None:
    """As the UI's Materialize of the whole graph (or `selection`) over RANGE stores it (Dagster adds
    AFTER_RANGE to lora_adapter, evaluation, promoted_model), finished having materialized `built`
    (asset: days)."""
    asset_graph = process.create_request_context().asset_graph
    backfill = PartitionBackfill.from_asset_partitions(
        backfill_id="wholegraph", asset_graph=asset_graph, partition_names=RANGE,
        asset_selection=[dg.AssetKey(name) for name in selection], backfill_timestamp=time.time(), tags={},
        dynamic_partitions_store=process.instance, all_partitions=False, title=None, description=None,
        run_config=None,
    )
    progress = backfill.get_asset_backfill_data(asset_graph)
    materialized = AssetGraphSubset.from_asset_partition_set(
        {AssetKeyPartitionKey(dg.AssetKey(name), None if name == "base_model" else day)
         for name, days in built.items() for day in days}, asset_graph)
    process.instance.add_backfill(backfill.with_asset_backfill_data(
        AssetBackfillData(**{**progress._asdict(), "materialized_subset": materialized}),
        dynamic_partitions_store=process.instance, asset_graph=asset_graph,
    ).with_status(BulkActionStatus.COMPLETED_FAILED))


def _mutation(process: WorkspaceProcessContext, query: str, params: dict, result_type: str) -> dict:
    (result,) = execute_dagster_graphql(process.create_request_context(), query, {"params": params}).data.values()
    assert result["__typename"] == result_type, result
    return result


def _launch(process: WorkspaceProcessContext, assets: list[str], tags: dict[str, str]) -> str:
    location = process.create_request_context().code_location_names[0]
    selector = {"repositoryLocationName": location, "repositoryName": "__repository__", "pipelineName": "__ASSET_JOB",
                "assetSelection": [{"path": [name]} for name in assets]}
    params = {"selector": selector, "mode": "default",
              "executionMetadata": {"tags": [{"key": key, "value": value} for key, value in tags.items()]}}
    return _mutation(process, LAUNCH_RUN, params, "LaunchRunSuccess")["run"]["runId"]


def _assert_skipped_without_output(instance: dg.DagsterInstance, run_id: str) -> None:
    run = instance.get_run_by_id(run_id)
    assert run.status == dg.DagsterRunStatus.SUCCESS
    warnings = [entry.user_message for entry in instance.all_logs(run_id) if entry.level == logging.WARNING]
    assert any(message.startswith(SKIPPED) for message in warnings), warnings
    assert instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION) == []


def _failure_of(instance: dg.DagsterInstance, run_id: str) -> str:
    (failure,) = instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_FAILURE)
    return failure.dagster_event.step_failure_data.error.message


def _shown_for(process: WorkspaceProcessContext, day: str) -> dict[str, str]:
    """What the UI shows for `day`: each asset's partition status and each evaluation gate's."""
    def status_of(ranges):
        return next((r["status"] for r in ranges if r["startKey"] <= day <= r["endKey"]), "MISSING")
    shown = {}
    for node in execute_dagster_graphql(process.create_request_context(), STATUSES).data["assetNodes"]:
        name = node["assetKey"]["path"][0]
        shown[name] = status_of(node["assetPartitionStatuses"].get("ranges", []))
        for check in (node["assetChecksOrError"] or {}).get("checks", []):
            shown[f"{name}:{check['name']}"] = status_of((check["partitionStatuses"] or {}).get("ranges", []))
    return shown


def _trained_and_passed_earlier(instance: dg.DagsterInstance, day: str) -> None:
    """The day's earlier good materializations and gate verdicts (as a run that trained it records them)."""
    for name in TRAINING:
        instance.report_runless_asset_event(dg.AssetMaterialization(name, partition=day))
    evaluated = instance.fetch_materializations(dg.AssetKey("evaluation"), limit=1).records[0]
    target = AssetCheckEvaluationTargetMaterializationData(
        storage_id=evaluated.storage_id, run_id=evaluated.run_id, timestamp=evaluated.timestamp)
    for gate in GATES:
        instance.report_runless_asset_event(dg.AssetCheckEvaluation(
            asset_key=dg.AssetKey("evaluation"), check_name=gate.split(":")[1], passed=True, partition=day,
            target_materialization_data=target))


def test_the_added_day_ends_without_output_keeping_its_earlier_materializations_and_verdicts(workspace):
    """The backfill page's "Re-execute" of a whole-graph backfill whose range trained: the new
    backfill holds only the added day's training, run by Dagster's backfill daemon."""
    instance = workspace.instance
    _finished_whole_graph_backfill(workspace, {name: RANGE for name in DATA + TRAINING})
    _trained_and_passed_earlier(instance, AFTER_RANGE)
    before = _shown_for(workspace, AFTER_RANGE)
    assert [before[key] for key in TRAINING + GATES] == ["MATERIALIZED"] * 3 + ["SUCCEEDED"] * 2

    params = {"parentRunId": "wholegraph", "strategy": "FROM_FAILURE"}
    new_id = _mutation(workspace, REEXECUTE_BACKFILL, params, "LaunchBackfillSuccess")["backfillId"]
    for _ in range(4):  # launch its run (executed at once), see it finish, then find nothing materialized
        list(execute_backfill_iteration(workspace, logging.getLogger(__name__)))
    reexecuted = instance.get_backfill(new_id)
    (run,) = instance.get_runs(dg.RunsFilter(tags={"dagster/backfill": new_id}))
    _assert_skipped_without_output(instance, run.run_id)

    shown = _shown_for(workspace, AFTER_RANGE)
    assert [shown[key] for key in TRAINING] == ["MATERIALIZED"] * 3  # not FAILED: the earlier models stand
    assert [shown[key] for key in GATES] == ["SKIPPED"] * 2  # no new verdict, failed or passed
    # The backfill still says the day was not run.
    assert reexecuted.status == BulkActionStatus.COMPLETED_FAILED
    failed = reexecuted.get_asset_backfill_data(workspace.create_request_context().asset_graph)
    assert {(key.asset_key.to_user_string(), key.partition_key)
            for key in failed.failed_and_downstream_subset.iterate_asset_partitions()} == {
        (name, AFTER_RANGE) for name in TRAINING}


def test_re_executing_the_skipped_run_skips_the_day_again(workspace):
    instance = workspace.instance
    _finished_whole_graph_backfill(workspace, {name: RANGE for name in DATA})
    skipped = _launch(workspace, TRAINING, {"dagster/backfill": "wholegraph", "dagster/partition": AFTER_RANGE})
    _assert_skipped_without_output(instance, skipped)

    # The run page's "Re-execute" (all steps; "from failure" of a run that failed gives the same tags).
    params = {"parentRunId": skipped, "strategy": "ALL_STEPS"}
    rerun_id = _mutation(workspace, REEXECUTE_RUN, params, "LaunchRunSuccess")["run"]["runId"]
    rerun_tags = instance.get_run_by_id(rerun_id).tags
    assert "dagster/backfill" not in rerun_tags and rerun_tags["dagster/root_run_id"] == skipped
    _assert_skipped_without_output(instance, rerun_id)


def test_re_executing_a_refused_evaluation_from_failure_refuses_it_again(workspace):
    """A backfill of the data with evaluation adds the next day's evaluation, which fails (its gates
    are outputs it must give): the UI's "Re-execute from failure" of that run."""
    instance = workspace.instance
    _finished_whole_graph_backfill(workspace, {name: RANGE for name in DATA},
                                   selection=["raw_examples", "training_dataset", "evaluation", "promoted_model"])
    refused = _launch(workspace, ["evaluation", "promoted_model"],
                      {"dagster/backfill": "wholegraph", "dagster/partition": AFTER_RANGE})
    assert SKIPPED in _failure_of(instance, refused)

    params = {"parentRunId": refused, "strategy": "FROM_FAILURE"}
    rerun_id = _mutation(workspace, REEXECUTE_RUN, params, "LaunchRunSuccess")["run"]["runId"]
    rerun_tags = instance.get_run_by_id(rerun_id).tags
    assert "dagster/backfill" not in rerun_tags and rerun_tags["dagster/root_run_id"] == refused
    assert SKIPPED in _failure_of(instance, rerun_id)


def test_re_executing_the_backfill_skips_the_added_day_in_the_new_backfill(workspace):
    instance = workspace.instance
    _finished_whole_graph_backfill(workspace, {name: RANGE for name in DATA})

    # The backfill page's "Re-execute" (from failure): a new backfill of training and promotion only.
    params = {"parentRunId": "wholegraph", "strategy": "FROM_FAILURE"}
    new_id = _mutation(workspace, REEXECUTE_BACKFILL, params, "LaunchBackfillSuccess")["backfillId"]
    new_backfill = instance.get_backfill(new_id)
    target = new_backfill.get_asset_backfill_data(workspace.create_request_context().asset_graph).target_subset
    assert {key.to_user_string() for key in target.asset_keys} == set(TRAINING)
    assert sorted(target.get_partitions_subset(dg.AssetKey("lora_adapter")).get_partition_keys()) == [
        *RANGE, AFTER_RANGE]

    # Its run of the added day, tagged as the backfill daemon tags its runs.
    run_id = _launch(workspace, TRAINING, {**new_backfill.tags, "dagster/backfill": new_id,
                                           "dagster/partition": AFTER_RANGE})
    _assert_skipped_without_output(instance, run_id)
