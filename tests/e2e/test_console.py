"""The web console in a real browser: Debian's Chromium driven by Playwright, against the
running stack (an API process with the test workflows, its workers, the fake provider).

Signs in, watches a job go queued -> running -> completed live, approves a review with a
corrected field, rejects one, redrives a dead-letter group of three, cancels a queued job,
and checks that another tenant's key sees none of it and that a review-only key cannot
redrive. Every page is saved as a screenshot at desktop and phone width under
tests/e2e/console-screenshots/ (git-ignored); no answer may be a 5xx and no script error
may reach the browser's console.

The browser is the distribution's (``make test`` installs the ``chromium`` package);
Playwright's own browser download is never used. Without /usr/bin/chromium the module is
skipped with the reason, and fails under CI=true.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from calmq.data import tenants
from calmq.sql import queries
from calmq.tooling.devstack import StackState
from tests.support.api import Api
from tests.support.workflow_env import WorkflowEnv

pytestmark = pytest.mark.e2e

CHROMIUM = Path("/usr/bin/chromium")
# Chromium's background connections (updates, sync, QUIC probes) are refused by a closed
# network; without these flags it stalls and logs errors that are not the console's.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SHOTS = Path(__file__).parent / "console-screenshots"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
INVOICE = "Vendor: Blurry Scan Ltd\nInvoice: 7?1\nTotal: EUR 88.00\n"
TIMEOUT_MS = 30_000


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="module")
def playwright() -> Iterator[Any]:
    if not CHROMIUM.exists():
        reason = ("Debian's chromium is not installed (/usr/bin/chromium): `make test` "
                  "installs it with apt-get install -y --no-install-recommends chromium")
        if _in_ci():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if _in_ci():
            pytest.fail("the playwright package is missing: pip install -e '.[dev]'")
        pytest.skip("the playwright package is missing: pip install -e '.[dev]'")
    with sync_playwright() as p:
        yield p


def expect(locator: Any) -> Any:
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(locator)


class Browser:
    """One Chromium (a fresh temporary profile), a context per signed-in key, and what
    went wrong in any of them: 5xx answers and script errors."""

    def __init__(self, playwright: Any, base_url: str) -> None:
        self.browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS,
                                                  headless=True)
        self.base_url = base_url
        self.problems: list[str] = []
        self.contexts: list[Any] = []
        SHOTS.mkdir(parents=True, exist_ok=True)

    def page(self) -> Any:
        context = self.browser.new_context(viewport=DESKTOP, base_url=self.base_url)
        context.set_default_timeout(TIMEOUT_MS)
        self.contexts.append(context)
        page = context.new_page()
        page.on("console", lambda m: m.type == "error" and not _expected(m.text)
                and self.problems.append(f"console error on {page.url}: {m.text}"))
        page.on("pageerror", lambda e: self.problems.append(f"script error on {page.url}: {e}"))
        page.on("response", lambda r: r.status >= 500 and self.problems.append(
            f"{r.status} from {r.url}"))
        return page

    def sign_in(self, key: str) -> Any:
        page = self.page()
        page.goto("/console/jobs")
        assert "/console/sign-in" in page.url  # not signed in: sent to the form
        page.get_by_label("API key").fill(key)
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_url(re.compile(r"/console/jobs"))
        return page

    def close(self) -> None:
        for c in self.contexts:
            c.close()
        self.browser.close()


def _expected(text: str) -> bool:
    # The browser logs every 4xx answer; the tests provoke some on purpose (a bad key's
    # 401, another tenant's 404). A 5xx is caught by the response hook, whatever this says.
    return bool(re.match(r"Failed to load resource: the server responded with a status of "
                         r"4\d\d", text))


def shot(page: Any, name: str) -> None:
    """The page as it is now, at desktop and at phone width."""
    page.screenshot(path=str(SHOTS / f"{name}-desktop.png"), full_page=True)
    page.set_viewport_size(PHONE)
    page.screenshot(path=str(SHOTS / f"{name}-phone.png"), full_page=True)
    # At phone width nothing may stick out sideways but scrollable tables.
    overflow = page.evaluate("document.documentElement.scrollWidth")
    assert overflow <= PHONE["width"] + 1, f"{name} is {overflow} px wide at phone width"
    page.set_viewport_size(DESKTOP)


class Env:
    def __init__(self, stack: StackState) -> None:
        self.wf = WorkflowEnv(stack, workers=False)
        self.db = stack.env["CALMQ_DATABASE_URL"]
        self.provider = stack.env["CALMQ_FAKE_PROVIDER_URL"]
        self.key = self.wf.api.key
        self.reviewer = tenants.add_key(self.db, self.wf.tenant_name, ("review",))
        self.other_name = f"other-{uuid.uuid4().hex[:8]}"
        _t, self.other_key = _create(self.db, self.other_name)
        self.platform = tenants.add_key(self.db, tenants.PLATFORM_TENANT, None, platform=True)
        self.workers = False

    def start_workers(self) -> None:
        if not self.workers:
            self.wf.start_workers()
            self.workers = True

    def provider_mode(self, mode: str | None) -> None:
        req = urllib.request.Request(self.provider + "/admin/mode", method="POST",
                                     data=json.dumps({"mode": mode}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200


def _create(db: str, name: str) -> tuple[str, str]:
    from tests.support.api import create_tenant

    return name, create_tenant(db, name)


@pytest.fixture(scope="module")
def env(stack: StackState) -> Iterator[Env]:
    e = Env(stack)
    try:
        yield e
    finally:
        e.provider_mode(None)
        e.wf.close()


@pytest.fixture(scope="module")
def browser(env: Env, playwright: Any) -> Iterator[Browser]:
    # env first: it uses asyncio.run, which cannot run inside Playwright's event loop.
    b = Browser(playwright, env.wf.api_url)
    try:
        yield b
    finally:
        b.close()
        print(f"\nconsole screenshots: {SHOTS}")


@pytest.fixture(scope="module")
def owner(browser: Browser, env: Env) -> Any:
    """Tenant A's full key, signed in (the sign-in test below checks the form itself)."""
    return browser.sign_in(env.key)


def test_sign_in_shows_who_and_rejects_a_bad_key(browser: Browser, env: Env, owner: Any
                                                 ) -> None:
    page = browser.page()
    page.goto("/console/sign-in")
    shot(page, "sign-in")
    page.get_by_label("API key").fill("cq_not-a-key")
    page.get_by_role("button", name="Sign in").click()
    assert "unknown or revoked" in page.get_by_role("alert").inner_text()
    [cookie] = [c for c in owner.context.cookies() if c["name"] == "calmq_console"]
    assert (cookie["httpOnly"], cookie["sameSite"]) == (True, "Strict")
    # Sign out forgets the cookie: the next page asks for a key again.
    leaving = browser.sign_in(env.key)
    leaving.get_by_role("button", name="Sign out").click()
    leaving.wait_for_url(re.compile(r"/console/sign-in"))
    assert not [c for c in leaving.context.cookies() if c["name"] == "calmq_console"]
    leaving.goto("/console/jobs")
    assert "/console/sign-in" in leaving.url
    who = owner.get_by_test_id("who").inner_text()
    assert f"tenant {env.wf.tenant_name}" in who
    assert owner.get_by_test_id("platform-banner").count() == 0


def test_cancel_a_queued_job(env: Env, owner: Any) -> None:
    """No worker runs yet: the job waits in queued, and the console's Cancel ends it, with
    who cancelled in its history."""
    job_id = env.wf.submit("summarize_t", {"text": "never mind", "mode": "success"})
    owner.goto(f"/console/jobs/{job_id}")
    assert owner.locator("#job-status").inner_text() == "queued"
    owner.get_by_role("button", name="Cancel the job").click()
    owner.wait_for_selector("#job-status.cancelled")
    job = env.wf.job(job_id)
    assert job["status"] == "cancelled"
    [cancelled] = [e for e in job["events"] if e["type"] == "cancelled"]
    assert cancelled["detail"] == {"by": env.wf.identity}


def test_the_live_refreshed_rows_equal_the_first_rendered_ones(owner: Any) -> None:
    """The jobs table refreshes from rows the server renders with the page's own template:
    after a refresh every row has the same cells as the page first showed, Priority
    included (a hand-written script renderer once dropped that column)."""
    owner.goto("/console/jobs?status=cancelled")
    table = owner.locator("table#jobs")
    headers = table.locator("thead th").all_inner_texts()

    def cells() -> list[list[str]]:
        rows: list[list[str]] = table.evaluate(
            "t => Array.from(t.tBodies[0].rows, r => Array.from(r.cells, c => c.innerHTML))")
        return rows

    first = cells()
    assert first, "the cancelled job of test_cancel_a_queued_job is listed"
    assert all(len(row) == len(headers) for row in first)
    assert first[0][headers.index("Priority")] in ("interactive", "bulk")
    expect(table).to_have_attribute("data-refreshed", re.compile(r"^[1-9]"))
    assert cells() == first


def test_watch_a_job_go_queued_running_completed_live(env: Env, owner: Any) -> None:
    job_id = env.wf.submit("summarize_t", {"text": "watch me", "mode": "success",
                                           "delay_ms": 1500}, )
    owner.goto("/console/jobs?priority=bulk")
    owner.wait_for_selector(f'a[href="/console/jobs/{job_id}"]')
    shot(owner, "jobs")
    owner.goto(f"/console/jobs/{job_id}")
    assert owner.locator("#job-status").inner_text() == "queued"
    env.start_workers()  # now the job can run: the page follows it over the API's SSE
    # What the page saw live, in order (kept across the reload when the job ends).
    expect(owner.locator("#job-status")).to_have_attribute(
        "data-seen", "queued running completed", timeout=60_000)
    expect(owner.locator("#job-status")).to_have_text("completed")
    owner.wait_for_load_state()
    assert "summary" in owner.locator("#artifact-h + pre").inner_text()
    download = owner.request.get(f"/console/jobs/{job_id}/artifact")
    assert download.status == 200
    assert "summary" in download.json()
    shot(owner, "job")
    # Priority and lane are separate filters; a lane no job of this tenant uses lists none.
    owner.goto("/console/jobs?lane=batch")
    owner.wait_for_selector("td.empty")
    body = owner.request.get("/console/jobs.json?priority=bulk&lane=online").json()
    assert job_id in [j["job_id"] for j in body["jobs"]]
    assert all(j["priority"] == "bulk" and j["lane"] == "online" for j in body["jobs"])
    assert owner.request.get("/console/jobs.json?lane=batch").json() == {"jobs": []}
    # A job id begins with its creation time (version 7): the jobs of the same minute share
    # its first eight characters, so the prefix reaches into its random bits.
    found = owner.request.get(f"/console/jobs.json?q={job_id[:23]}").json()["jobs"]
    assert [j["job_id"] for j in found] == [job_id]


def _awaiting_review(env: Env) -> str:
    env.start_workers()
    job_id = env.wf.submit("invoice_t", {"text": INVOICE, "mode": "low_confidence"})
    job = env.wf.wait_status(job_id, "awaiting_review", "completed", "dead_letter")
    assert job["status"] == "awaiting_review", job
    return job_id


def test_a_streamed_jobs_text_appears_live_on_its_page(env: Env, owner: Any) -> None:
    """A streamed job's page shows the text as the model writes it (output.delta over the
    API's SSE); what it gathered live is exactly the stored result."""
    job_id = env.wf.submit("draft_t", {"prompt": "words as they come", "tokens": 200,
                                       "tokens_per_second": 20})
    owner.goto(f"/console/jobs/{job_id}")
    # The first deltas, shown while the model still writes (200 tokens take 10 s).
    expect(owner.locator("#output")).not_to_have_attribute("data-deltas", "0")
    expect(owner.locator("#output-section")).to_be_visible()
    expect(owner.locator("#job-status")).to_have_text("completed", timeout=60_000)
    # The page reloads itself for the result once the stream ends: wait for the page the
    # server rendered after the end (a screenshot taken mid-reload never finishes).
    expect(owner.locator('#timeline[data-terminal="1"]')).to_have_count(1, timeout=60_000)
    owner.wait_for_load_state()
    stored = owner.request.get(f"/console/jobs/{job_id}/artifact").json()["text"]
    expect(owner.locator("#output")).to_have_text(stored)
    assert int(owner.locator("#output").get_attribute("data-deltas")) >= 2
    shot(owner, "job-streamed")


def test_approve_a_review_with_a_corrected_field(env: Env, owner: Any) -> None:
    job_id = _awaiting_review(env)
    owner.goto("/console/reviews")
    shot(owner, "reviews")
    owner.locator(f'a[href="/console/reviews/{job_id}"]').click()
    field = owner.get_by_label("invoice_number (required)")
    assert field.input_value() == "7?1"
    shot(owner, "review")
    # A value the step's output model refuses is refused like the API does (422).
    owner.get_by_label("currency (required)").fill("EURO")
    owner.get_by_role("button", name="Approve").click()
    assert "do not fit" in owner.get_by_role("alert").inner_text()
    owner.get_by_label("currency (required)").fill("EUR")
    owner.get_by_label("invoice_number (required)").fill("791")
    owner.get_by_role("button", name="Approve").click()
    job = env.wf.wait_status(job_id, "completed", "dead_letter")
    assert job["status"] == "completed", job
    [reviewed] = [e["detail"] for e in job["events"] if e["type"] == "reviewed"]
    assert reviewed["reviewer"] == env.wf.identity
    assert reviewed["fields"] == {"invoice_number": "791"}
    owner.goto(f"/console/jobs/{job_id}")
    assert '"791"' in owner.locator("#artifact-h + pre").inner_text()
    assert env.wf.ledger.for_job(job_id)[0]["fields"]["invoice_number"] == "791"


def test_reject_a_review_and_it_dead_letters(env: Env, owner: Any) -> None:
    job_id = _awaiting_review(env)
    owner.goto(f"/console/reviews/{job_id}")
    # A reason PostgreSQL cannot store is refused on the form, and nothing is decided.
    csrf = owner.locator('input[name="csrf"]').first.get_attribute("value")
    answer = owner.request.post(f"/console/reviews/{job_id}", form={
        "csrf": csrf, "decision": "reject", "reason": "nul\x00reason"},
        headers={"Origin": env.wf.api_url})
    assert answer.status == 422
    assert "NUL character" in answer.text()
    assert env.wf.job(job_id)["status"] == "awaiting_review"
    owner.keyboard.press("r")  # the shortcut goes to the reason
    owner.keyboard.type("the scan is unreadable")
    owner.get_by_role("button", name="Reject").click()
    owner.wait_for_url(re.compile(r"done=rejected"))
    job = env.wf.wait_status(job_id, "dead_letter", "completed")
    assert job["status"] == "dead_letter"
    assert job["error"]["code"] == "review_rejected"
    [reviewed] = [e["detail"] for e in job["events"] if e["type"] == "reviewed"]
    assert reviewed["reviewer"] == env.wf.identity
    owner.goto(f"/console/jobs/{job_id}")
    assert owner.locator("#job-status").inner_text() == "dead_letter"
    assert "review_rejected" in owner.locator("#timeline").inner_text()


def test_redrive_a_dead_letter_group_of_three(browser: Browser, env: Env, owner: Any) -> None:
    env.start_workers()
    ids = [env.wf.submit("summarize_t", {"text": f"bad {i}", "mode": "malformed"})
           for i in range(3)]
    for job_id in ids:
        assert env.wf.wait_status(job_id, "dead_letter", "completed")["status"] == "dead_letter"
    watcher = browser.sign_in(env.key)  # a second tab that only watches the count
    watcher.goto("/console/dead-letters")
    count = watcher.locator('[data-group="summarize_t|summarize|verifier|malformed_output"]')
    assert count.inner_text() == "3"
    shot(watcher, "dead-letters")
    owner.goto("/console/dead-letters")
    owner.get_by_role("row", name=re.compile("malformed_output")).get_by_role(
        "link", name="Open").click()
    assert owner.locator("input.pick:checked").count() == 3
    shot(owner, "dead-letter-group")
    env.provider_mode("success")  # the cause is fixed
    try:
        owner.get_by_label("Reason for the redrive").fill("provider fixed")
        owner.get_by_role("button", name="Redrive selected").click()
        assert "Redrive 3 dead letter(s)" in owner.get_by_test_id("confirm-count").inner_text()
        shot(owner, "redrive-confirm")
        owner.get_by_role("button", name="Redrive 3 job(s)").click()
        owner.wait_for_url(re.compile(r"done=3"))
        # The watching tab's count drops without a reload.
        expect(count).to_have_text("0")
        for job_id in ids:
            job = env.wf.wait_status(job_id, "completed", "dead_letter")
            assert job["status"] == "completed", job
            [redriven] = [e["detail"] for e in job["events"] if e["type"] == "redriven"]
            assert (redriven["by"], redriven["reason"]) == (env.wf.identity, "provider fixed")
    finally:
        env.provider_mode(None)
    owner.goto(f"/console/jobs/{ids[0]}")
    assert "redriven" in owner.locator("#timeline").inner_text()


def test_overview_shows_backlog_throughput_reviews_and_spend(env: Env, owner: Any) -> None:
    owner.goto("/console/overview")
    for heading in ("Backlog and queue age", "Throughput", "Reviews", "Tokens and cost"):
        assert owner.get_by_role("heading", name=heading).is_visible()
    assert owner.locator("figure.chart svg").count() >= 1
    assert "%" in owner.get_by_test_id("dlq-rate").inner_text()
    shot(owner, "overview")


def test_overview_names_blocked_providers_and_models_with_no_price(
        browser: Browser, env: Env, owner: Any) -> None:
    """A provider and model blocked fleet-wide shows on the overview with its reason (the
    provider's own message to a platform key only), and a model with no price is named."""
    model = f"fake-blocked-{uuid.uuid4().hex[:6]}"  # nobody calls it: the block holds no job
    with psycopg.connect(env.db) as conn:
        conn.execute(queries()["provider_block"], {
            "provider": f"openai:{env.provider}/v1", "model": model,
            "reason": "invalid_api_key", "code": "provider_auth",
            "message": "Incorrect API key provided: sk-test***"})
    try:
        owner.goto("/console/overview")
        blocked = owner.get_by_test_id("blocked-providers")
        expect(blocked.locator("tr", has_text=model)).to_contain_text("invalid_api_key")
        assert "Incorrect API key" not in blocked.inner_text()
        expect(owner.get_by_test_id("unpriced-models")).to_contain_text(model)
        shot(owner, "overview-providers")
        platform = browser.sign_in(env.platform)
        platform.goto("/console/overview")
        expect(platform.get_by_test_id("blocked-providers").locator("tr", has_text=model)
               ).to_contain_text("Incorrect API key provided")
    finally:
        with psycopg.connect(env.db) as conn:
            conn.execute("DELETE FROM provider_states WHERE model = %s", (model,))


def test_another_tenant_sees_nothing_of_the_first(browser: Browser, env: Env, owner: Any
                                                  ) -> None:
    """Tenant B's console, its JSON and the API under its cookie: 404 or absent, for tenant
    A's jobs, objects and reviews alike."""
    mine = env.wf.submit("summarize_t", {"text": "private", "mode": "success"})
    env.wf.wait_status(mine, "completed")
    waiting = _awaiting_review(env)
    other = browser.sign_in(env.other_key)
    listed = other.request.get("/console/jobs.json").json()["jobs"]
    assert {mine, waiting} & {j["job_id"] for j in listed} == set()
    assert other.request.get(f"/console/jobs.json?q={mine}").json() == {"jobs": []}
    assert other.request.get("/console/reviews.json").json() == {"reviews": []}
    assert other.request.get("/console/dead-letters.json").json() == {"groups": []}
    for path in (f"/console/jobs/{mine}", f"/console/jobs/{mine}.json",
                 f"/console/jobs/{mine}/input", f"/console/jobs/{mine}/artifact",
                 f"/console/reviews/{waiting}",
                 f"/v1/jobs/{mine}", f"/v1/jobs/{mine}/artifact", f"/v1/jobs/{mine}/events"):
        assert other.request.get(path).status == 404, path
    other.goto("/console/jobs")
    assert other.locator(f'a[href="/console/jobs/{mine}"]').count() == 0
    # A form of tenant B's session cannot act on tenant A's job either.
    csrf = other.locator('input[name="csrf"]').first.get_attribute("value")
    answer = other.request.post(f"/console/reviews/{waiting}",
                                form={"csrf": csrf, "decision": "reject", "reason": "x"},
                                headers={"Origin": env.wf.api_url})
    assert answer.status == 404
    assert env.wf.job(waiting)["status"] == "awaiting_review"
    # A form without the CSRF token is refused before anything happens.
    answer = owner.request.post(f"/console/reviews/{waiting}",
                                form={"decision": "reject", "reason": "x"})
    assert answer.status == 403
    assert env.wf.job(waiting)["status"] == "awaiting_review"


def test_a_review_only_key_cannot_redrive(browser: Browser, env: Env) -> None:
    env.start_workers()
    dead = env.wf.submit("summarize_t", {"text": "still bad", "mode": "malformed"})
    assert env.wf.wait_status(dead, "dead_letter", "completed")["status"] == "dead_letter"
    page = browser.sign_in(env.reviewer)
    assert page.get_by_role("link", name="Dead letters").count() == 0
    assert page.get_by_role("link", name="Reviews").count() == 1
    assert page.request.get("/console/dead-letters").status == 403
    csrf = page.locator('input[name="csrf"]').first.get_attribute("value")
    answer = page.request.post("/console/dead-letters/redrive", form={
        "csrf": csrf, "job_id": dead, "reason": "r", "confirm": "yes"},
        headers={"Origin": env.wf.api_url})
    assert answer.status == 403
    status, _h, body = Api(env.wf.api_url, env.reviewer).call(
        "POST", f"/v1/dead-letters/{dead}/redrive", {"reason": "r"})
    assert (status, body["code"]) == (403, "role_forbidden")
    assert env.wf.job(dead)["status"] == "dead_letter"


def test_a_platform_key_sees_every_tenant_and_says_so(browser: Browser, env: Env) -> None:
    theirs = Api(env.wf.api_url, env.other_key).submit({"text": "b", "mode": "success"},
                                                         workflow="summarize_t")
    mine = env.wf.submit("summarize_t", {"text": "a", "mode": "success"})
    page = browser.sign_in(env.platform)
    for path in ("/console/jobs", "/console/overview", "/console/reviews",
                 "/console/dead-letters"):
        page.goto(path)
        assert "every tenant" in page.get_by_test_id("platform-banner").inner_text(), path
    listed = {j["job_id"] for j in page.request.get("/console/jobs.json").json()["jobs"]}
    assert {theirs, mine} <= listed
    # The fleet's view of the overview: consumer lag per topic and group (the workers of
    # this module's pools have committed offsets by now).
    page.goto("/console/overview")
    lag = page.get_by_test_id("consumer-lag")
    assert lag.is_visible()
    assert "calmq.wft" in lag.inner_text()
    shot(page, "platform-overview")
    page.goto(f"/console/jobs/{theirs}")
    shot(page, "platform-job")


def test_no_5xx_and_no_script_error(browser: Browser) -> None:
    """Last: everything the browser met in this module's tests."""
    assert browser.problems == []
