"""Bulk actions from the terminal on the real stack: count, confirmation, paging, rate,
progress, interruption and resume, summary and exit codes (calmq.cli.bulk)."""

from __future__ import annotations

import json
import os
import pty
import select
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from calmq.tooling.devstack import StackState
from tests.support.cli import (
    calmq,
    calmq_argv,
    calmq_env,
    insert_jobs,
    new_tenant,
    redriven_counts,
    statuses,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration


def _redrive(tenant: str, *more: str) -> list[str]:
    return ["dlq", "redrive", "--tenant", tenant, "--reason", "test fix", "--by", "oncall@test",
            *more]


def test_interrupted_redrive_of_1000_resumes_redriving_each_exactly_once(
    stack: StackState, tmp_path: Path
) -> None:
    """SIGINT half-way: exit 130 and a checkpoint; --resume finishes the rest, every job is
    redriven exactly once, and dead letters that appeared after the start are left alone."""
    name, tenant_id, _key = new_tenant(stack, "bulk1k")
    ids = insert_jobs(stack, tenant_id, 1000)
    checkpoint = tmp_path / "redrive.json"
    # A page of 100 (past --limit: all 1000 are processed), 250 jobs/s: about 4 s in all.
    proc = subprocess.Popen(
        calmq_argv(*_redrive(name, "--yes", "--limit", "100", "--rate", "250",
                             "--checkpoint", str(checkpoint))),
        env=calmq_env(stack), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    first = proc.stderr.readline()
    assert first.startswith("1000 dead letters to redrive"), first  # the count comes first
    seen: list[str] = []
    while True:  # plain progress lines (stderr is no terminal): one per tenth of the work
        line = proc.stderr.readline()
        assert line, f"calmq ended before half-way: {seen}"
        seen.append(line)
        if line.startswith("redrive: ") and int(line.split()[1].split("/")[0]) >= 400:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "--resume" in err
    assert out.splitlines()[-1].endswith(" redriven")  # the summary of what it did
    saved = json.loads(checkpoint.read_text())
    assert saved["finished"] is False
    half = sum(redriven_counts(stack, ids).values())
    assert 400 <= half < 1000, half
    assert saved["done"] == half  # the checkpoint counts exactly what was done

    # Dead letters made after the first run started are outside its frozen filter.
    later = insert_jobs(stack, tenant_id, 5)
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        conn.execute("UPDATE jobs SET updated_at = now() WHERE id = ANY(%s)", (later,))

    resumed = calmq(stack, "dlq", "redrive", "--resume", str(checkpoint), "--yes",
                    "-o", "json")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.startswith(f"{1000 - half} dead letters to redrive ({half} handled")
    report = json.loads(resumed.stdout)
    assert (report["done"], report["failed"], report["finished"]) == (1000, {}, True)
    assert len([o for o in report["outcomes"] if o["outcome"] == "redriven"]) == 1000 - half

    counts = redriven_counts(stack, ids)
    assert len(counts) == 1000
    assert set(counts.values()) == {1}  # each exactly once
    assert set(redriven_counts(stack, later).values()) == {0}
    assert set(statuses(stack, later).values()) == {"dead_letter"}

    again = calmq(stack, "dlq", "redrive", "--resume", str(checkpoint), "--yes")
    assert again.returncode == 0
    assert "finished already" in again.stderr

    # The redriven jobs really run again, and finish; waiting here also leaves the shared
    # pool empty for the tests after this one instead of 1,000 jobs ahead of theirs.
    wait_for(lambda: set(statuses(stack, ids).values()) == {"completed"}, timeout=180,
             what="the 1,000 redriven jobs to complete")


def test_sigterm_stops_a_redrive_resumably_too(stack: StackState, tmp_path: Path) -> None:
    """SIGTERM (a stopped pod, a killed shell) is an interruption like Ctrl-C: exit 130, and
    the resumed run redrives the rest, each job once."""
    name, tenant_id, _key = new_tenant(stack, "bulkterm")
    ids = insert_jobs(stack, tenant_id, 40)
    checkpoint = tmp_path / "c.json"
    proc = subprocess.Popen(
        calmq_argv(*_redrive(name, "--yes", "--rate", "10", "--checkpoint", str(checkpoint))),
        env=calmq_env(stack), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    while not (line := proc.stderr.readline()).startswith("redrive: "):
        assert line, "calmq ended before its first progress line"
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert 0 < sum(redriven_counts(stack, ids).values()) < 40

    resumed = calmq(stack, "dlq", "redrive", "--resume", str(checkpoint), "--yes")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.splitlines()[-1] == "40 redriven"  # both runs' work in one summary
    assert set(redriven_counts(stack, ids).values()) == {1}


def test_without_a_terminal_a_bulk_redrive_needs_yes(stack: StackState, tmp_path: Path) -> None:
    """Not a terminal and no --yes: the count, then exit 2 and nothing redriven."""
    name, tenant_id, _key = new_tenant(stack, "bulkyes")
    ids = insert_jobs(stack, tenant_id, 3)
    refused = calmq(stack, *_redrive(name, "--checkpoint", str(tmp_path / "c.json")))
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.splitlines()
    assert lines[0].startswith("3 dead letters to redrive")
    assert "calmq: error [confirmation_required]: refusing to redrive 3 dead letters" in lines[-1]
    assert set(redriven_counts(stack, ids).values()) == {0}

    dry = calmq(stack, *_redrive(name, "--dry-run", "-o", "json"))
    assert dry.returncode == 0, dry.stderr  # a dry run writes nothing, so it asks nothing
    assert json.loads(dry.stdout)["done"] == 3
    assert set(redriven_counts(stack, ids).values()) == {0}


def test_calmq_yes_in_the_environment_is_refused_not_read(stack: StackState,
                                                         tmp_path: Path) -> None:
    """CALMQ_YES=1 confirms nothing: exit 2 naming it, with or without --yes, none redriven."""
    name, tenant_id, _key = new_tenant(stack, "bulkenvyes")
    ids = insert_jobs(stack, tenant_id, 3)
    env = {**calmq_env(stack), "CALMQ_YES": "1"}
    for more in ((), ("--yes",)):
        refused = calmq(stack, *_redrive(name, *more, "--checkpoint",
                                          str(tmp_path / "c.json")), env=env)
        assert refused.returncode == 2, refused.stderr
        assert "[confirmation_from_environment]" in refused.stderr
    assert set(redriven_counts(stack, ids).values()) == {0}


def test_a_bulk_redrive_runs_with_no_home_folder_to_write(stack: StackState,
                                                          tmp_path: Path) -> None:
    """As in the image: no home folder to write and no XDG state folder, the default
    checkpoint goes under the temporary directory and the redrive completes."""
    name, tenant_id, _key = new_tenant(stack, "bulkrohome")
    ids = insert_jobs(stack, tenant_id, 4)
    # A home that is a file: nothing can be created under it, even by root (chmod would not
    # stop root, and the tests may run as root).
    home = tmp_path / "home"
    home.write_text("")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**calmq_env(stack), "HOME": str(home), "TMPDIR": str(scratch)}
    env.pop("XDG_STATE_HOME", None)
    done = calmq(stack, *_redrive(name, "--yes"), env=env)
    assert done.returncode == 0, done.stderr
    assert set(redriven_counts(stack, ids).values()) == {1}
    written = list(scratch.glob(f"calmq-{os.getuid()}/bulk/dlq-redrive-*.json"))
    assert len(written) == 1, done.stderr


def test_jsonl_outcomes_partial_exit_3_and_summary(stack: StackState, tmp_path: Path) -> None:
    """-o jsonl: one outcome per line then the summary; a job that cannot run again is
    reported failed with its reason and the exit code is 3."""
    name, tenant_id, _key = new_tenant(stack, "bulkpart")
    good = insert_jobs(stack, tenant_id, 4)
    gone = insert_jobs(stack, tenant_id, 2, workflow="retired-workflow")
    done = calmq(stack, *_redrive(name, "--yes", "-o", "jsonl", "--limit", "3",
                                  "--checkpoint", str(tmp_path / "c.json")))
    assert done.returncode == 3, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]  # every line is JSON
    outcomes, summary = rows[:-1], rows[-1]["summary"]
    assert {uuid.UUID(o["job_id"]): o["outcome"] for o in outcomes} == {
        **dict.fromkeys(good, "redriven"), **dict.fromkeys(gone, "rejected")}
    assert {o["code"] for o in outcomes if o["outcome"] == "rejected"} == {"unknown_workflow"}
    assert (summary["matched"], summary["done"], summary["failed"]) == (
        6, 4, {"unknown_workflow": 2})
    assert set(statuses(stack, gone).values()) == {"dead_letter"}

    table = calmq(stack, *_redrive(name, "--yes"))  # only the two rejected still match
    assert table.returncode == 3
    assert table.stdout.splitlines()[-1] == "0 redriven, 2 failed (unknown_workflow: 2)"


def test_an_unreachable_database_is_exit_1_with_its_address(stack: StackState) -> None:
    env = calmq_env(stack, CALMQ_DATABASE_URL="postgresql://calmq@127.0.0.1:9/calmq")
    started = time.monotonic()
    res = calmq(stack, *_redrive("anyone", "--yes"), env=env)
    assert res.returncode == 1
    assert res.stderr.startswith("calmq: error [database_unreachable]: PostgreSQL at "
                                 "127.0.0.1:9/calmq is not reachable")
    assert "Traceback" not in res.stderr
    assert time.monotonic() - started < 10


def _pty_run(argv: list[str], env: dict[str, str], answer: str | None,
             timeout: float = 60) -> tuple[int, str]:
    """Run on a pseudo-terminal (stdin, stdout and stderr); type ``answer`` at the prompt."""
    main_fd, sub_fd = pty.openpty()
    proc = subprocess.Popen(argv, env=env, stdin=sub_fd, stdout=sub_fd, stderr=sub_fd,
                            close_fds=True)
    os.close(sub_fd)
    screen, answered = b"", answer is None
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main_fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(main_fd, 4096)
                except OSError:  # the child closed the terminal: it has ended
                    break
                if not chunk:
                    break
                screen += chunk
            if not answered and b"[y/N]" in screen:
                os.write(main_fd, (answer or "").encode() + b"\n")
                answered = True
            if proc.poll() is not None and not ready:
                break
        return proc.wait(timeout=10), screen.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(main_fd)


def test_confirmation_on_a_terminal_refused_then_accepted(stack: StackState,
                                                          tmp_path: Path) -> None:
    """On a terminal the count is asked about: "n" leaves every job dead, "yes" redrives."""
    name, tenant_id, _key = new_tenant(stack, "bulktty")
    ids = insert_jobs(stack, tenant_id, 5)
    argv = calmq_argv(*_redrive(name, "--checkpoint", str(tmp_path / "c.json")))
    code, screen = _pty_run(argv, calmq_env(stack), "n")
    assert code == 1, screen
    # The question names what it acts on: the database and the Kafka cluster.
    db = conninfo_to_dict(stack.env["CALMQ_DATABASE_URL"])
    assert (f"redrive 5 dead letters on database {db['host']}:{db['port']}/{db['dbname']}, "
            f"Kafka {stack.env['CALMQ_KAFKA_BOOTSTRAP']}? [y/N]") in screen
    assert "calmq: error [not_confirmed]" in screen
    assert set(redriven_counts(stack, ids).values()) == {0}

    code, screen = _pty_run(argv, calmq_env(stack), "yes")
    assert code == 0, screen
    assert "5 redriven" in screen
    assert set(redriven_counts(stack, ids).values()) == {1}


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_progress_bar_advances_on_a_terminal_during_a_paced_redrive(
    stack: StackState, tmp_path: Path
) -> None:
    """In tmux, a --rate 20 redrive of 80 jobs shows a bar whose count grows."""
    name, tenant_id, _key = new_tenant(stack, "bulkbar")
    insert_jobs(stack, tenant_id, 80)
    script = tmp_path / "run.sh"
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in calmq_env(stack).items()
                      if k.startswith(("CALMQ_", "PYTHON", "PATH", "HOME")))
    command = shlex.join(calmq_argv(*_redrive(name, "--yes", "--rate", "20",
                                            "--checkpoint", str(tmp_path / "c.json"))))
    script.write_text(f"{exports}{command}\necho EXIT=$?\nsleep 120\n")
    session = f"calmq-test-{uuid.uuid4().hex[:8]}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "20",
                    f"bash {script}"], check=True)

    def screen() -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", session],
                              capture_output=True, text=True, check=True).stdout

    def done_count() -> int:
        for line in screen().splitlines():
            if line.startswith("redrive [") and "/80" in line:
                return int(line.split("] ")[1].split("/")[0])
        return 0

    try:
        try:
            first = wait_for(done_count, timeout=30, what="a progress bar with a count")
        except AssertionError:
            raise AssertionError(f"no progress bar on the screen:\n{screen()}") from None
        second = wait_for(lambda: (n := done_count()) > first and n, timeout=30,
                          what="the progress bar's count to grow")
        assert first < second <= 80
        assert "/s ETA " in screen()  # the bar shows its rate and time left
        wait_for(lambda: "EXIT=0" in screen(), timeout=30, what="the redrive to end")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
