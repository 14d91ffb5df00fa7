"""The Prefect UI in a real browser: Playwright drives headless Chromium against a local Prefect server.

`sluiceway serve` serves the rl deployment; the test opens the deployment's custom-run form in the UI, changes
one field of the run config, submits it, waits for the run (tiny-llama, 2 steps) to complete, then finds the
run and its artifacts in the UI. Screenshots go to the test's tmp dir and to tests/artifacts/ (ignored by git).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from paths import TESTS
from prefect_server import TINY_RUN_FLAGS, sluiceway_cmd, stop

from sluiceway.storage.object_store import ObjectStore
from sluiceway.storage.trajectories import read_trajectories

CHROMIUM = os.environ.get("SLUICEWAY_CHROMIUM", "/usr/bin/chromium")
SHOTS = TESTS / "artifacts"

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason=f"no Chromium at {CHROMIUM}: `make install` installs Debian's chromium with apt-get where it runs as "
    "root; elsewhere install it yourself or point SLUICEWAY_CHROMIUM at one",
)


def _field(page, label: str):
    """The input of a Prefect schema-form property, found by its label text."""
    box = page.get_by_text(label, exact=True).first.locator(
        "xpath=ancestor::div[contains(concat(' ', @class, ' '), ' p-label ')][1]"
    )
    return box.locator(".p-label__body input, .p-label__body textarea").first


def _shot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    SHOTS.mkdir(exist_ok=True)
    shutil.copy(path, SHOTS / name)
    return path


def _wait_for(fn, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(1)
    raise TimeoutError(what)


def test_trigger_the_rl_deployment_from_the_ui_and_find_its_artifacts(tmp_path, prefect_server):
    from playwright.sync_api import expect, sync_playwright

    run_dir = tmp_path / "run"
    server = prefect_server  # the session's, shared with test_deployments.py (tests/integration/conftest.py)
    env = server.env(SLUICEWAY_CACHE=str(tmp_path / "cache"))
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        serve = subprocess.Popen(
            sluiceway_cmd("serve", "--flow", "rl", "--name", "tiny-llama", *TINY_RUN_FLAGS,
                          "--output-dir", str(run_dir)),
            env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:

        def deployment():
            assert serve.poll() is None, log.read_text()[-3000:]
            try:
                return server.deployment("sluiceway-rl", "tiny-llama")
            except httpx.HTTPStatusError:
                return None

        dep = _wait_for(deployment, 180, "the deployment was not registered")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            # expect's own default is 5 s: the custom-run form renders the whole run config, which took longer on a
            # loaded 2-core machine (a benchmark beside the suite)
            expect.set_options(timeout=60_000)

            # The deployment in the UI, then its custom-run form: the run config as a form.
            page.goto(server.url + "/deployments")
            page.get_by_role("link", name="tiny-llama", exact=True).click()
            page.wait_for_url(f"**/deployments/deployment/{dep['id']}**")
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_text("Custom run", exact=True).click()
            page.wait_for_url(re.compile(rf"/deployments/deployment/{dep['id']}/run(\?.*)?$"))
            expect(_field(page, "Prompt Data (Optional)")).to_have_value("env:arithmetic")
            expect(_field(page, "Rollout Max Response Len (Optional)")).to_have_value("4")
            _field(page, "Run Name").fill("ui-form-run")
            _field(page, "Rollout Max Response Len (Optional)").fill("3")
            _shot(page, tmp_path, "ui-custom-run-form.png")
            page.get_by_role("button", name="Submit", exact=True).click()

            def submitted():
                runs = server.post("/flow_runs/filter", {"flow_runs": {"name": {"any_": ["ui-form-run"]}}})
                return runs[0] if runs else None

            run = _wait_for(submitted, 60, "the form created no flow run")
            final = server.wait_flow_run(run["id"])
            assert final["state_type"] == "COMPLETED", server.logs_of(run["id"]) + log.read_text()[-3000:]
            assert final["parameters"]["config"]["rollout"]["rollout_max_response_len"] == 3

            # The run in the UI: the runs list, its page, its artifacts.
            page.goto(server.url + "/runs")
            page.get_by_role("link", name="ui-form-run").first.click()
            page.wait_for_url(f"**/runs/flow-run/{run['id']}**")
            expect(page.get_by_text("Completed").first).to_be_visible()
            page.get_by_text("Artifacts", exact=True).first.click()
            for kind in ("progress", "metrics", "curves", "storage"):
                expect(page.get_by_text(f"sluiceway-run-{kind}", exact=True)).to_be_visible()
            shot = _shot(page, tmp_path, "ui-flow-run-artifacts.png")
            page.get_by_text("sluiceway-run-metrics", exact=True).click()
            page.wait_for_url("**/artifacts/artifact/**")
            expect(page.get_by_role("columnheader", name="reward", exact=True)).to_be_visible()
            _shot(page, tmp_path, "ui-metrics-artifact.png")
            # The curves artifact: its chart is a data:image/png in the markdown, and the UI shows it.
            page.goto(server.url + "/runs")
            page.get_by_role("link", name="ui-form-run").first.click()
            page.wait_for_url(f"**/runs/flow-run/{run['id']}**")
            page.get_by_text("Artifacts", exact=True).first.click()
            page.get_by_text("sluiceway-run-curves", exact=True).click()
            page.wait_for_url("**/artifacts/artifact/**")
            chart = page.locator('img[src^="data:image/png"]').first
            expect(chart).to_be_visible()
            assert chart.evaluate("e => e.complete && e.naturalWidth") > 0  # the PNG decoded
            _shot(page, tmp_path, "ui-curves-artifact.png")
            browser.close()
    finally:
        stop(serve)
    assert shot.stat().st_size > 10_000
    rows = read_trajectories(ObjectStore.from_uri(str(run_dir / "tables")), "run").to_pylist()
    assert {r["step"] for r in rows} == {0, 1}
    assert max(len(r["response_token_ids"]) for r in rows) <= 3  # the value typed into the form
