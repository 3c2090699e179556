"""Rerun from a step on the real stack (issue 43): POST /v1/jobs/{id}/rerun and the bulk
`calmq jobs rerun`, with a three-step workflow whose every step is a paid call counted at
the fake provider (tests/support/rerun_workflows.py)."""

from __future__ import annotations

import json
import re
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from calmq.tooling.devstack import StackState
from tests.support.api import Api, NoRedirect, console_session
from tests.support.cli import calmq, calmq_env, insert_jobs
from tests.support.fanout_workflows import NAME as FANOUT
from tests.support.fanout_workflows import POOL as FANOUT_POOL
from tests.support.rerun_workflows import NAME, POOL
from tests.support.waiting import wait_for
from tests.support.workers import Procs, create_pool_topics, create_tenant_id

pytestmark = pytest.mark.integration

MODULES = "tests.support.rerun_workflows,tests.support.fanout_workflows"
TERMINAL = ("completed", "dead_letter", "cancelled")


class RerunEnv:
    """An API and a worker that know the rerun workflow, and a tenant of the module's own."""

    def __init__(self, stack: StackState) -> None:
        self.stack = stack
        self.db = stack.env["CALMQ_DATABASE_URL"]
        for pool in (POOL, FANOUT_POOL):
            create_pool_topics(stack.env["CALMQ_KAFKA_BOOTSTRAP"], pool, ["5s"])
        self.settings = {"workflow_modules": MODULES, "retry_tiers": "5s"}
        self.procs = Procs(stack.env, Path(tempfile.mkdtemp(prefix="calmq-rerun-logs-")))
        self.api_url = self.procs.api(**self.settings)
        self.tenant_name = f"rerun-{uuid.uuid4().hex[:8]}"
        self.tenant, key = create_tenant_id(self.db, self.tenant_name)
        self.api = Api(self.api_url, key)
        self.procs.worker(POOL, **self.settings)
        self.procs.worker(FANOUT_POOL, **self.settings)

    def submit(self, text: str, *, workflow: str = NAME, input_: dict[str, Any] | None = None,
               **fields: Any) -> str:
        status, _h, body = self.api.call("POST", "/v1/jobs", {
            "workflow": workflow, "input": input_ or {"text": text}, **fields})
        assert status == 202, body
        return str(body["job_id"])

    def finished(self, job_id: str, timeout: float = 60) -> dict[str, Any]:
        job: dict[str, Any] = wait_for(
            lambda: (j := self.api.job(job_id))["status"] in TERMINAL and j,
            timeout=timeout, what=f"job {job_id} to finish")
        assert job["status"] == "completed", (job["error"], job["events"])
        return job

    def rerun(self, job_id: str, body: dict[str, Any], api: Api | None = None
              ) -> tuple[int, Any]:
        status, _h, answer = (api or self.api).call("POST", f"/v1/jobs/{job_id}/rerun", body)
        return status, answer

    def provider_calls(self, job_id: str) -> int:
        url = self.stack.env["CALMQ_FAKE_PROVIDER_URL"] + "/stats"
        with urllib.request.urlopen(url, timeout=5) as resp:
            stats = json.loads(resp.read())
        return int(stats["by_job"].get(job_id, {}).get("calls", 0))

    def attempts(self, job_id: str) -> dict[str, int]:
        with psycopg.connect(self.db, row_factory=dict_row) as conn:
            rows = conn.execute("SELECT step, count(*)::int AS n FROM job_attempts "
                                "WHERE job_id = %s GROUP BY step", (job_id,)).fetchall()
        return {r["step"]: r["n"] for r in rows}

    def artifact(self, job_id: str) -> dict[str, Any]:
        status, _h, body = self.api.call("GET", f"/v1/jobs/{job_id}/artifact")
        assert status == 200, body
        return dict(body)

    def summary(self, job_id: str) -> str:
        return str(self.artifact(job_id)["summary"])


@pytest.fixture(scope="module")
def env(stack: StackState) -> Iterator[RerunEnv]:
    made = RerunEnv(stack)
    try:
        yield made
    finally:
        made.procs.stop_all()


def test_rerun_from_step_two_reuses_step_one_and_names_the_original(env: RerunEnv) -> None:
    """A rerun from the second of three steps is a new job that makes no call for the first
    step, completes, shows rerun_of, and whose history's first event names the original."""
    original = env.submit("alpha beta gamma delta")
    env.finished(original)
    assert env.provider_calls(original) == 3

    status, answer = env.rerun(original, {"from_step": "draft"})
    assert status == 202, answer
    new = answer["job_id"]
    assert new != original
    assert answer["rerun_of"] == original
    assert (answer["status"], answer["status_url"]) == ("queued", f"/v1/jobs/{new}")

    job = env.finished(new)
    assert env.provider_calls(new) == 2  # draft and polish: 0 calls for outline
    assert env.attempts(new) == {"draft": 1, "polish": 1}
    assert env.provider_calls(original) == 3  # nothing of the original ran again
    assert job["rerun_of"] == original
    first = job["events"][0]
    assert first["type"] == "queued"
    assert first["detail"]["rerun_of"] == original
    assert first["detail"]["from_step"] == "draft"
    assert env.summary(new) == env.summary(original)
    assert env.api.job(original)["rerun_of"] is None


def test_rerun_uses_the_replacement_input_of_its_step(env: RerunEnv) -> None:
    """The input of a rerun replaces the previous step's recorded output for from_step (and
    the job's input for the first step), and only the steps from from_step are called."""
    original = env.submit("one two three")
    env.finished(original)

    status, answer = env.rerun(original, {"from_step": "polish",
                                          "input": {"summary": "replaced words here"}})
    assert status == 202, answer
    assert env.finished(answer["job_id"])
    assert env.summary(answer["job_id"]) == "replaced words here"
    assert env.provider_calls(answer["job_id"]) == 1

    status, answer = env.rerun(original, {"from_step": "outline",
                                          "input": {"text": "a fresh start"}})
    assert status == 202, answer
    env.finished(answer["job_id"])
    assert env.summary(answer["job_id"]) == "a fresh start"
    assert env.provider_calls(answer["job_id"]) == 3


def test_rerun_after_a_spawning_step_gets_the_originals_children(env: RerunEnv) -> None:
    """A rerun from the step after one that started children gets the original's children
    (in input order) and starts none of its own: no child runs again."""
    texts = ["first child text", "second child text"]
    original = env.submit("", workflow=FANOUT, input_={"texts": texts})
    env.finished(original)
    before = env.artifact(original)
    status, answer = env.rerun(original, {"from_step": "gather"})
    assert status == 202, answer
    env.finished(answer["job_id"])
    assert env.artifact(answer["job_id"]) == before
    assert [c["summary"] for c in before["children"]] == texts
    with psycopg.connect(env.db) as conn:
        spawned = conn.execute("SELECT count(*) FROM jobs WHERE parent_id = %s",
                               (answer["job_id"],)).fetchone()
    assert spawned == (0,)


def test_rerun_refusals_have_stable_codes(env: RerunEnv) -> None:
    """Unknown step 422 unknown_step, bad replacement 422 invalid_input, a job still in
    flight 409 job_not_terminal, a job without the earlier step's output 409
    step_outputs_missing, another tenant's job 404; none of them makes a job."""
    original = env.submit("refusals here")
    env.finished(original)
    with psycopg.connect(env.db) as conn:
        before = conn.execute("SELECT count(*) FROM jobs WHERE rerun_of IS NOT NULL"
                              ).fetchone()

    def code(job_id: str, body: dict[str, Any], api: Api | None = None) -> tuple[int, str]:
        status, answer = env.rerun(job_id, body, api)
        return status, answer["code"]

    assert code(original, {"from_step": "nope"}) == (422, "unknown_step")
    assert code(original, {"from_step": "draft", "input": {"other": 1}}) == (
        422, "invalid_input")
    assert code(original, {"from_step": "outline", "input": {"text": ""}}) == (
        422, "invalid_input")
    [queued] = insert_jobs(env.stack, env.tenant, 1, status="queued", workflow=NAME)
    assert code(str(queued), {"from_step": "outline"}) == (409, "job_not_terminal")
    [dead] = insert_jobs(env.stack, env.tenant, 1, workflow=NAME)
    assert code(str(dead), {"from_step": "draft"}) == (409, "step_outputs_missing")
    _other, key = create_tenant_id(env.db, f"rerun-other-{uuid.uuid4().hex[:8]}")
    assert code(original, {"from_step": "draft"}, Api(env.api_url, key)) == (404, "not_found")
    assert code(str(uuid.uuid4()), {"from_step": "draft"}) == (404, "not_found")
    with psycopg.connect(env.db) as conn:
        after = conn.execute("SELECT count(*) FROM jobs WHERE rerun_of IS NOT NULL").fetchone()
    assert after == before


def test_a_keyed_rerun_answers_the_same_new_job_and_refuses_another_body(
        env: RerunEnv) -> None:
    """With an Idempotency-Key, the same body answers the same new job (one job made, also
    by two requests at once); another body, another job or a submit under the key is 409
    idempotency_key_reused, as for POST /v1/jobs; a malformed key is 400 invalid_header."""
    original = env.submit("keyed rerun words")
    env.finished(original)
    key = {"Idempotency-Key": f"rerun-{uuid.uuid4()}"}

    def rerun(job_id: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, Any]:
        status, _h, answer = env.api.call("POST", f"/v1/jobs/{job_id}/rerun", body,
                                          headers=headers)
        return status, answer

    status, first = rerun(original, {"from_step": "draft"}, key)
    assert status == 202, first
    status, again = rerun(original, {"from_step": "draft"}, key)
    assert (status, again) == (202, first)
    with ThreadPoolExecutor(4) as pool:  # a race of twins under a fresh key: one job
        twin = {"Idempotency-Key": f"rerun-{uuid.uuid4()}"}
        answers = list(pool.map(lambda _i: rerun(original, {"from_step": "polish"}, twin),
                                range(4)))
    assert {a[0] for a in answers} == {202}, answers
    assert len({a[1]["job_id"] for a in answers}) == 1, answers
    with psycopg.connect(env.db) as conn:
        made = conn.execute("SELECT count(*) FROM jobs WHERE rerun_of = %s",
                            (original,)).fetchone()
    assert made == (2,)
    assert env.finished(first["job_id"])["rerun_of"] == original

    other = env.submit("another original")
    env.finished(other)
    for job_id, body in ((original, {"from_step": "polish"}),
                         (original, {"from_step": "draft", "priority": "bulk"}),
                         (other, {"from_step": "draft"})):
        status, answer = rerun(job_id, body, key)
        assert (status, answer["code"]) == (409, "idempotency_key_reused"), answer
    status, _h, answer = env.api.call("POST", "/v1/jobs", {
        "workflow": NAME, "input": {"text": "a submit"}}, headers=key)
    assert (status, answer["code"]) == (409, "idempotency_key_reused"), answer
    status, answer = rerun(original, {"from_step": "draft"}, {"Idempotency-Key": ""})
    assert (status, answer["code"]) == (400, "invalid_header"), answer
    with psycopg.connect(env.db) as conn:
        made = conn.execute("SELECT count(*) FROM jobs WHERE rerun_of = ANY(%s::uuid[])",
                            ([original, other],)).fetchone()
    assert made == (2,)


def test_bulk_rerun_counts_estimates_confirms_then_reruns_each(env: RerunEnv,
                                                               tmp_path: Path) -> None:
    """`calmq jobs rerun` by filter shows the count and the estimated cost, refuses to go on
    unconfirmed off a terminal, then makes one rerun per match, each calling only the
    steps it reruns."""
    tag = uuid.uuid4().hex[:8]
    originals = [env.submit(f"bulk {i} words", metadata={"batch": tag}) for i in range(4)]
    other = env.submit("not in the batch", metadata={"batch": "other"})
    for job_id in [*originals, other]:
        env.finished(job_id)
    cli_env = calmq_env(env.stack, CALMQ_WORKFLOW_MODULES=MODULES)
    argv = ("jobs", "rerun", "--from-step", "polish", "--workflow", NAME, "--tenant",
            env.tenant_name, "--status", "completed", "--metadata", f"batch={tag}")

    dry = calmq(env.stack, *argv, "--dry-run", env=cli_env)
    assert dry.returncode == 0, dry.stderr
    assert "4 jobs to rerun" in dry.stderr
    assert "estimated cost" in dry.stderr
    unconfirmed = calmq(env.stack, *argv, env=cli_env)
    assert unconfirmed.returncode == 2, unconfirmed.stderr
    assert "confirmation" in unconfirmed.stderr or "--yes" in unconfirmed.stderr

    def reruns() -> dict[str, str]:
        with psycopg.connect(env.db, row_factory=dict_row) as conn:
            rows = conn.execute("SELECT id::text, rerun_of::text FROM jobs "
                                "WHERE rerun_of = ANY(%s::uuid[])",
                                ([*originals, other],)).fetchall()
        return {r["id"]: r["rerun_of"] for r in rows}

    assert reruns() == {}
    done = calmq(env.stack, *argv, "--yes", "--checkpoint", str(tmp_path / "c.json"),
                 env=cli_env)
    assert done.returncode == 0, done.stderr
    made = reruns()
    assert sorted(made.values()) == sorted(originals)
    for new in made:
        env.finished(new)
        assert env.provider_calls(new) == 1  # polish alone
    # Resuming the finished run reruns nothing again.
    again = calmq(env.stack, "jobs", "rerun", "--resume", str(tmp_path / "c.json"), "--yes",
                  env=cli_env)
    assert again.returncode == 0, again.stderr
    assert reruns() == made


def _console(url: str, session: str, form: dict[str, str] | None = None
             ) -> tuple[int, str, str]:
    """A console page (GET) or form post (POST, redirects not followed): status, body and
    Location."""
    headers = {"Cookie": f"calmq_console={session}"}
    data = None
    if form is not None:
        data = urllib.parse.urlencode(form).encode()
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    req = urllib.request.Request(url, data=data, headers=headers,
                                 method="POST" if form is not None else "GET")
    try:
        with urllib.request.build_opener(NoRedirect).open(req, timeout=30) as resp:
            return resp.status, resp.read().decode(), resp.headers.get("Location", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), exc.headers.get("Location", "")


def test_console_job_page_reruns_from_the_chosen_step(env: RerunEnv) -> None:
    """A job that ended shows a "Rerun from step" form with its steps; posting it (with the
    page's CSRF token) makes the rerun and opens the new job's page."""
    original = env.submit("console words here")
    env.finished(original)
    session = console_session(env.api_url, env.api.key)
    status, page, _ = _console(f"{env.api_url}/console/jobs/{original}", session)
    assert status == 200
    form = re.search(r'<form[^>]*action="/console/jobs/[^"]+/rerun".*?</form>', page)
    assert form, "no rerun form on the job page"
    assert re.findall(r'<option value="([^"]+)"', form.group(0)) == [
        "outline", "draft", "polish"]
    csrf = re.search(r'name="csrf" value="([^"]+)"', form.group(0))
    assert csrf
    status, _body, location = _console(f"{env.api_url}/console/jobs/{original}/rerun",
                                       session, {"csrf": csrf.group(1), "from_step": "polish"})
    assert status == 303, _body
    new = location.rsplit("/", 1)[-1]
    assert env.finished(new)["rerun_of"] == original
    assert env.provider_calls(new) == 1
    refused, _body, _ = _console(f"{env.api_url}/console/jobs/{original}/rerun", session,
                                 {"csrf": "stale", "from_step": "polish"})
    assert refused == 403
