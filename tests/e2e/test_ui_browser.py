"""The Dagster UI in a real browser: `dagster dev` + headless Chromium.

Checks what a person opening `make ui` sees — every asset of the graph and the blocking check,
the job, each schedule/sensor on the automation page — then materializes the demo partition
through the webserver's GraphQL API (as the UI's "Materialize" button does) and saves a
screenshot of the asset graph afterwards to $TESSERA_ARTIFACTS_DIR (default tests/artifacts/).
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from assets.partitions import DEMO_PARTITION
from tests.e2e.ui_support import (
    ChromiumUnavailable,
    DagsterDev,
    artifacts_dir,
    asset_nodes,
    chromium_browser,
    latest_materializations,
    launch_asset_backfill,
    launch_partition_run,
    materialized_partitions,
    repository_contents,
    run_failure_summary,
    running_dagster_dev,
    wait_for_backfill,
    wait_for_run,
    wait_for_stable_box,
)

pytestmark = pytest.mark.e2e

ASSET_KEYS = [
    "raw_examples", "training_dataset", "row_group_cache", "base_model",
    "lora_adapter", "evaluation", "promoted_model",
]
CHECK_NAME = "beats_base_model"
CHECKED_ASSET = "evaluation"
JOB_NAME = "train_and_promote"
READY_TIMEOUT_S = float(os.environ.get("TESSERA_E2E_READY_TIMEOUT_S", "300"))
RUN_TIMEOUT_S = float(os.environ.get("TESSERA_E2E_RUN_TIMEOUT_S", "1800"))
# Wide enough that the whole graph is drawn with full asset nodes (names, check status), not the
# zoomed-out name-only boxes.
VIEWPORT = {"width": 2400, "height": 1300}
PAGE_TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium; the module skips when it cannot be installed or started."""
    with ExitStack() as stack:
        try:
            chromium = stack.enter_context(chromium_browser())
        except ChromiumUnavailable as error:
            pytest.skip(f"Chromium unavailable: {error}")
        yield chromium


@pytest.fixture(scope="module")
def dagster_ui(browser, tmp_path_factory) -> Iterator[DagsterDev]:
    """`dagster dev` on a free loopback port with a fresh TESSERA_HOME (state as `tessera demo`
    lays it out). Depends on `browser` so a missing Chromium skips before the server starts."""
    root = tmp_path_factory.mktemp("ui")
    with running_dagster_dev(root / "tessera", artifacts_dir() / "ui_dagster_dev.log", READY_TIMEOUT_S) as dev:
        yield dev


@dataclass
class UiPage:
    """One browser tab on the Dagster UI, recording uncaught JavaScript errors."""

    page: Any
    base_url: str
    errors: list[str] = field(default_factory=list)

    def open(self, path: str) -> None:
        self.page.goto(self.base_url + path, wait_until="networkidle", timeout=PAGE_TIMEOUT_MS)

    def assert_no_errors(self) -> None:
        assert not self.errors, "uncaught JavaScript errors in the UI:\n" + "\n".join(self.errors)

    @contextmanager
    def screenshot_on_failure(self, name: str) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.page.screenshot(path=str(artifacts_dir() / f"ui_failure_{name}.png"))
            raise


@pytest.fixture
def ui(browser, dagster_ui) -> Iterator[UiPage]:
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(PAGE_TIMEOUT_MS)
    page = context.new_page()
    tab = UiPage(page=page, base_url=dagster_ui.url)
    page.on("pageerror", lambda error: tab.errors.append(str(error)))
    try:
        yield tab
    finally:
        context.close()  # a closed tab stops polling the webserver while the run trains


def graph_node(page: Any, asset_key: str) -> Any:
    """An asset's box in the lineage graph (not its group's box, which may share the name)."""
    return (
        page.locator("svg foreignObject")
        .filter(has=page.get_by_text(asset_key, exact=True))
        .filter(has_not=page.locator('[aria-label^="unfold"]'))
    )


def link_to(page: Any, path_suffix: str, text: str) -> Any:
    """The first link whose target ends with `path_suffix` and that shows `text`."""
    return page.locator(f'a[href$="{path_suffix}"]').filter(has_text=text).first


def open_expanded_asset_graph(ui: UiPage) -> None:
    """Global asset lineage with every group expanded (⌥E, the graph's own shortcut) and the
    navigation hidden, so the graph gets the whole width."""
    ui.open("/asset-groups")
    ui.page.get_by_text("Global asset lineage").wait_for()
    ui.page.get_by_text("Hide navigation").click()
    ui.page.locator("svg foreignObject").first.wait_for(state="visible")  # groups drawn, collapsed
    ui.page.keyboard.press("Alt+e")
    for key in ASSET_KEYS:
        graph_node(ui.page, key).wait_for(state="visible")
    wait_for_stable_box(graph_node(ui.page, ASSET_KEYS[-1]))


def test_asset_graph_shows_every_asset_and_the_check(dagster_ui: DagsterDev, ui: UiPage) -> None:
    nodes = asset_nodes(dagster_ui)
    assert set(ASSET_KEYS) <= set(nodes), f"GraphQL asset keys: {sorted(nodes)}"
    checks = {check["name"]: check for check in nodes[CHECKED_ASSET]["assetChecksOrError"]["checks"]}
    assert CHECK_NAME in checks and checks[CHECK_NAME]["blocking"], checks

    with ui.screenshot_on_failure("asset_graph"):
        open_expanded_asset_graph(ui)
        for key in ASSET_KEYS:
            node = graph_node(ui.page, key)
            assert node.count() == 1, f"{key}: {node.count()} boxes in the lineage graph"
            assert node.is_visible(), f"{key} is not visible in the lineage graph"

    with ui.screenshot_on_failure("asset_checks"):
        ui.open(f"/assets/{CHECKED_ASSET}?view=checks")
        ui.page.get_by_text(CHECK_NAME, exact=True).first.wait_for(state="visible")
        ui.page.get_by_text("This is a blocking asset check.").wait_for(state="visible")
    ui.assert_no_errors()


def test_job_is_listed(dagster_ui: DagsterDev, ui: UiPage) -> None:
    jobs = {job["name"] for job in repository_contents(dagster_ui)["jobs"]}
    assert JOB_NAME in jobs, jobs
    with ui.screenshot_on_failure("jobs"):
        ui.open("/jobs")
        link_to(ui.page, f"/jobs/{JOB_NAME}", JOB_NAME).wait_for(state="visible")
    ui.assert_no_errors()


def test_automation_page_lists_every_schedule_and_sensor(dagster_ui: DagsterDev, ui: UiPage) -> None:
    repository = repository_contents(dagster_ui)
    for schedule in repository["schedules"]:
        assert schedule["pipelineName"], f"schedule {schedule['name']} targets no job"
    automations = [f"/schedules/{item['name']}" for item in repository["schedules"]]
    automations += [f"/sensors/{item['name']}" for item in repository["sensors"]]
    with ui.screenshot_on_failure("automation"):
        ui.open("/automation")
        if not automations:
            ui.page.get_by_text("No automations", exact=True).wait_for(state="visible")
        for path in automations:
            link_to(ui.page, path, path.rsplit("/", 1)[1]).wait_for(state="visible")
    ui.assert_no_errors()


def test_demo_partition_materializes_and_the_graph_shows_it(dagster_ui: DagsterDev, ui: UiPage) -> None:
    started = time.monotonic()
    run_id = launch_partition_run(dagster_ui, JOB_NAME, DEMO_PARTITION)
    status = wait_for_run(dagster_ui, run_id, RUN_TIMEOUT_S, on_poll=dagster_ui.remember_descendants)
    assert status == "SUCCESS", (
        f"run {run_id} ended {status} after {time.monotonic() - started:.0f} s:\n"
        f"{run_failure_summary(dagster_ui, run_id)}"
    )
    assert_materialized_by(dagster_ui, run_id)

    screenshot = artifacts_dir() / "ui_asset_graph_after_demo.png"
    with ui.screenshot_on_failure("after_run"):
        open_expanded_asset_graph(ui)
        # The check's result is drawn in the evaluation node once the run's events have loaded.
        graph_node(ui.page, CHECKED_ASSET).get_by_text("Passed").wait_for(state="visible")
        wait_for_stable_box(graph_node(ui.page, ASSET_KEYS[-1]))
        ui.page.screenshot(path=str(screenshot))
    ui.assert_no_errors()
    assert_real_screenshot(screenshot)


def assert_materialized_by(dev: DagsterDev, run_id: str) -> None:
    """Every asset's latest materialization comes from this run (for DEMO_PARTITION where
    partitioned), and the blocking check passed on it."""
    nodes = latest_materializations(dev)
    for key in ASSET_KEYS:
        events = nodes[key]["assetMaterializations"]
        assert events and events[0]["runId"] == run_id, f"{key}: latest materialization {events}"
        if nodes[key]["isPartitioned"]:
            assert events[0]["partition"] == DEMO_PARTITION, f"{key}: {events[0]}"
    checks = {check["name"]: check for check in nodes[CHECKED_ASSET]["assetChecksOrError"]["checks"]}
    execution = checks[CHECK_NAME]["executionForLatestMaterialization"]
    assert execution and execution["runId"] == run_id and execution["status"] == "SUCCEEDED", execution


def assert_real_screenshot(path: Path) -> None:
    """A PNG of the viewport's size with more on it than a blank or single-colour page."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (VIEWPORT["width"], VIEWPORT["height"]), (width, height)
    assert len(data) > 50_000, f"{path}: only {len(data)} bytes"
    from PIL import Image

    with Image.open(path) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1_000_000) or []
    assert len(colours) > 50, f"{path}: {len(colours)} distinct colours — a blank page?"


def test_two_day_backfill_materializes_each_partition_exactly_once(dagster_ui: DagsterDev) -> None:
    # Runs after the demo run, so base_model (unpartitioned, upstream of training_dataset) exists.
    days = ["2026-11-02", "2026-11-03"]
    backfill_id = launch_asset_backfill(dagster_ui, ["raw_examples", "training_dataset"], days)
    status = wait_for_backfill(dagster_ui, backfill_id, RUN_TIMEOUT_S)
    assert status in {"COMPLETED", "COMPLETED_SUCCESS"}, status
    for asset_key in ("raw_examples", "training_dataset"):
        assert materialized_partitions(dagster_ui, asset_key, days) == days, asset_key
