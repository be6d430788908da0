"""What an operator sees in the Prefect UI, checked in a real browser.

Real parts: the session's `prefect server start`, one redeploy flow run on a bed of two emulated
nodes, and Debian's Chromium (/usr/bin/chromium) driven by Playwright's Python package with that
system browser (never `playwright install`: nothing is downloaded).

Prefect 3.9 serves two UIs. The server root sends a browser without a saved preference to the
new one (V2, React) under /v2; the classic one (V1, Vue) keeps the root paths. Routes, read from
the installed bundles (prefect/server/ui-v2 and prefect/server/ui) and checked here:
- V2: /v2/runs (flow run list), /v2/runs/flow-run/$id?tab=Artifacts, /v2/artifacts/artifact/$id
- V1: /runs/flow-run/:flowRunId?tab=Artifacts

Screenshots go to tests/output/ (gitignored); look at them after a run.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from flows.redeploy import redeploy_vllm_cluster
from tests.conftest import make_bed
from tests.testbed.procs import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]  # a bed and a flow run

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
]
OUTPUT = Path(__file__).parent / "output"
CLUSTER = "bed"  # the bed's cluster name: artifact keys are <cluster>-summary and <cluster>-load
TIMEOUT_MS = 15_000


@dataclass(frozen=True)
class UIRun:
    root: str  # the UI's root URL (the API URL without /api)
    flow_run_id: str
    flow_run_name: str
    steps: list[str]  # the steps the flow reports, in order
    artifacts: dict[str, dict[str, Any]]  # key -> the artifact as the API returns it


@pytest.fixture(scope="session")  # session: checked before the session's Prefect server starts
def chromium() -> Path:
    if CHROMIUM.exists():
        return CHROMIUM
    reason = f"{CHROMIUM} is missing: apt-get install chromium (scripts/setup.sh does)"
    if os.environ.get("CI"):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def ui_run(chromium: Path, prefect_api: str) -> Iterator[UIRun]:
    """One completed redeploy, recorded on the session's Prefect server."""
    bed = make_bed(2, "h200", first_ip=111)
    try:
        path = bed.write_config(
            bed.root / "ui.toml",
            vllm={"env": {"VRD_LOAD_SECONDS": "3"}},
            # Ray's GCS listens on every address, so beds running side by side (other checkouts
            # on this machine) must not share the default 6379.
            ray={"port": free_port("0.0.0.0")},
        )
        state = redeploy_vllm_cluster(str(path), "redeploy", return_state=True)
        assert state.is_completed(), str(state.result(raise_on_failure=False))
        run_id = str(state.state_details.flow_run_id)
        with httpx.Client(base_url=prefect_api, timeout=10) as api:
            name = api.get(f"/flow_runs/{run_id}").raise_for_status().json()["name"]
            found = api.post(
                "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [run_id]}}}
            ).raise_for_status()
        artifacts = {a["key"]: a for a in found.json() if a.get("key")}
        yield UIRun(
            root=prefect_api.removesuffix("/api"),
            flow_run_id=run_id,
            flow_run_name=name,
            steps=list(state.result()["steps"]),
            artifacts=artifacts,
        )
    finally:
        bed.down()


@pytest.fixture(scope="module")
def browser(chromium: Path, ui_run: UIRun) -> Iterator[Browser]:
    # After the flow run: the sync API runs an event loop in this thread while it is open, and
    # Prefect's sync calls (state.result()) would return coroutines under it.
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(chromium), headless=True, args=CHROMIUM_ARGS
        )
        yield browser
        browser.close()


@pytest.fixture
def page(ui_run: UIRun, browser: Browser) -> Iterator[Page]:
    """A fresh profile per test (a new context: no cookies, no saved UI preference); requests
    anywhere but the Prefect server are refused (the V2 UI asks an analytics host)."""
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    origin = urlsplit(ui_run.root).netloc

    def only_the_server(route: Any) -> None:
        if urlsplit(route.request.url).netloc == origin:
            route.continue_()
        else:
            route.abort()

    context.route("**/*", only_the_server)
    yield context.new_page()
    context.close()


@pytest.fixture(scope="module", autouse=True)
def _output_dir() -> None:
    OUTPUT.mkdir(exist_ok=True)


def shot(page: Page, name: str) -> None:
    page.screenshot(path=str(OUTPUT / name), full_page=True)


def artifact_id(ui_run: UIRun, suffix: str) -> str:
    key = f"{CLUSTER}-{suffix}"
    assert key in ui_run.artifacts, f"no artifact {key} on the run: {sorted(ui_run.artifacts)}"
    return ui_run.artifacts[key]["id"]


def wait_for_the_url_to_settle(page: Page, quiet_s: float = 1.5, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    url, since = page.url, time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"the URL kept changing: {page.url}"
        page.wait_for_timeout(100)
        if page.url != url:
            url, since = page.url, time.monotonic()


def open_artifacts_tab(page: Page, ui_run: UIRun) -> None:
    page.goto(f"{ui_run.root}/v2/runs/flow-run/{ui_run.flow_run_id}")
    page.get_by_role("tab", name="Artifacts").click()
    expect(page).to_have_url(re.compile(r"[?&]tab=Artifacts"))


def test_root_leads_to_the_flow_run_and_both_artifacts(page: Page, ui_run: UIRun) -> None:
    page.goto(ui_run.root + "/")
    expect(page).to_have_url(re.compile(r"/v2/"))  # the default UI
    page.get_by_role("link", name="Runs", exact=True).click()
    page.get_by_placeholder("Search by flow run name").fill(ui_run.flow_run_name)
    # The search reaches the URL after a debounce; a click before it lands on the run's page
    # and the late URL update then sends the UI to /v2/runs?tab=Logs&flow-run-search=..., an
    # error page. A person waits for the list to filter, and so does the test.
    expect(page).to_have_url(re.compile(r"[?&]flow-run-search="))
    # It then adds &page=1 in a second, later update, once the filtered list has loaded (seen on
    # a busy machine): wait for the list to show the run and the URL to stay put, as a person
    # reads the list before clicking.
    run_link = page.get_by_role("link", name=ui_run.flow_run_name, exact=True).first
    expect(run_link).to_be_visible()
    wait_for_the_url_to_settle(page)
    run_link.click()
    expect(page).to_have_url(re.compile(rf"/v2/runs/flow-run/{ui_run.flow_run_id}"))
    expect(page.get_by_text("Completed", exact=True).first).to_be_visible()

    page.get_by_role("tab", name="Artifacts").click()
    grid = page.get_by_test_id("flow-run-artifacts-grid")
    summary = grid.get_by_role("link").filter(has_text=f"{CLUSTER}-summary")
    load = grid.get_by_role("link").filter(has_text=f"{CLUSTER}-load")
    expect(summary).to_be_visible()
    expect(load).to_be_visible()
    page.wait_for_timeout(2000)  # the run graph (a canvas, nothing to await) fits itself in
    shot(page, "flow-run-artifacts.png")
    expect(summary).to_contain_text("MARKDOWN")
    expect(load).to_contain_text("PROGRESS")
    expect(summary).to_have_attribute(
        "href", f"/v2/artifacts/artifact/{artifact_id(ui_run, 'summary')}"
    )
    expect(load).to_have_attribute("href", f"/v2/artifacts/artifact/{artifact_id(ui_run, 'load')}")


def test_summary_artifact_page_renders_the_markdown(page: Page, ui_run: UIRun) -> None:
    open_artifacts_tab(page, ui_run)
    page.get_by_test_id("flow-run-artifacts-grid").get_by_role("link").filter(
        has_text=f"{CLUSTER}-summary"
    ).click()
    expect(page).to_have_url(re.compile(f"/v2/artifacts/artifact/{artifact_id(ui_run, 'summary')}"))
    markdown = page.get_by_test_id("markdown-display")
    expect(markdown.locator("h1").first).to_have_text(f"{CLUSTER}: redeployed")
    table = markdown.locator("table").first
    expect(table.locator("thead th")).to_have_text(["step", "seconds"])
    shot(page, "summary-artifact.png")
    shown = table.locator("tbody tr td:first-child").all_inner_texts()
    assert set(ui_run.steps) <= set(shown), f"steps {ui_run.steps}, table {shown}"
    for seconds in table.locator("tbody tr td:nth-child(2)").all_inner_texts():
        assert re.fullmatch(r"\d+(\.\d+)?", seconds.strip()), seconds

    # The markdown source, as the operator can read it on the Raw tab.
    page.get_by_role("tab", name="Raw").click()
    raw = page.get_by_text("| step | seconds |", exact=False).first
    expect(raw).to_be_visible()
    text = raw.inner_text()
    assert text.lstrip().startswith(f"# {CLUSTER}: redeployed"), text[:200]


def test_progress_artifact_page_shows_the_load_complete(page: Page, ui_run: UIRun) -> None:
    assert ui_run.artifacts[f"{CLUSTER}-load"]["data"] == 100
    open_artifacts_tab(page, ui_run)
    page.get_by_test_id("flow-run-artifacts-grid").get_by_role("link").filter(
        has_text=f"{CLUSTER}-load"
    ).click()
    expect(page).to_have_url(re.compile(f"/v2/artifacts/artifact/{artifact_id(ui_run, 'load')}"))
    expect(page.get_by_test_id("progress-display")).to_have_text("Progress: 100%")
    shot(page, "progress-artifact.png")


def test_classic_ui_lists_both_artifacts_on_the_flow_run(page: Page, ui_run: UIRun) -> None:
    page.set_viewport_size({"width": 1440, "height": 1400})  # V1 scrolls inside the page
    page.goto(f"{ui_run.root}/runs/flow-run/{ui_run.flow_run_id}")
    expect(page.get_by_text(ui_run.flow_run_name, exact=True).first).to_be_visible()
    page.get_by_text("Artifacts", exact=True).click()
    expect(page).to_have_url(re.compile(r"[?&]tab=Artifacts"))
    for key in (f"{CLUSTER}-summary", f"{CLUSTER}-load"):
        expect(page.get_by_text(key, exact=True).last).to_be_visible()
    shot(page, "flow-run-artifacts-v1.png")
