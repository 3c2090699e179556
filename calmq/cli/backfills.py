"""``calmq submit --file jobs.jsonl``: a backfill from one file, through POST /v1/jobs/bulk.

Each line is a POST /v1/jobs JSON body (``workflow``, ``input``, ``metadata``, ...; an
``idempotency_key`` of its own is kept). Lines go in chunks of ``--chunk-size`` (at most the
API's api_bulk_max_jobs), each chunk one request and one transaction, ``--in-flight``
chunks at once (default 4).

Nothing is submitted twice, whatever stops the run:

- every line without a key of its own is sent with one made of the file's SHA-256 and the
  line's number, the same in every run of the same file: a line sent again is answered
  ``duplicate`` with its job, never written again;
- after each chunk a checkpoint (beside the file by default, ``--checkpoint``) records the
  first line not yet answered and the counts so far, written atomically. A run of the same
  file starts after it; if the process died before the checkpoint caught up, the chunk
  sent again is all duplicates (the keys above), so the checkpoint is a shortcut, not what
  makes a resume safe. A checkpoint of another file's content is refused.

A line that is not a JSON object is reported with its number and not sent; an item the API
refuses is reported with its line and problem code; neither stops the others. A chunk the
API did not answer (429, 503, the network) is sent again after a pause (the keys make that
safe). The end is a summary: accepted, duplicate, refused by code, bad lines, the rate.
Exit 0 when every line was accepted or a duplicate, 3 when some were refused or bad, 130
when stopped early (``--max-chunks``, Ctrl-C): run it again to resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from calmq.cli.bulk import Progress
from calmq.cli.output import Exit, Format
from calmq.errors import ConfigError, UsageError

__all__ = ["Backfill", "run_file"]

CHECKPOINT_VERSION = 1
INTERRUPTED = 130
_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
_MAX_TRIES = 8
_BAD_LINES_SHOWN = 50


@dataclass
class Backfill:
    """Where a run of one file stands: the next line to send and what was answered."""

    path: Path
    sha256: str
    next_line: int = 1  # 1-based, as the lines are reported
    counts: Counter[str] = field(default_factory=Counter)  # accepted, duplicate, refused, bad
    refused_by_code: Counter[str] = field(default_factory=Counter)
    problems: list[dict[str, Any]] = field(default_factory=list)  # bad and refused lines

    def to_json(self) -> dict[str, Any]:
        return {"version": CHECKPOINT_VERSION, "file": str(self.path), "sha256": self.sha256,
                "next_line": self.next_line, "counts": dict(self.counts),
                "refused_by_code": dict(self.refused_by_code),
                "problems": self.problems[:_BAD_LINES_SHOWN]}

    def save(self, where: Path) -> None:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = where.with_name(where.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2))
        os.replace(tmp, where)  # atomic: a reader sees the old checkpoint or the new

    @classmethod
    def resume(cls, path: Path, sha256: str, where: Path) -> Backfill:
        """The run recorded at ``where`` for this file, or a new one."""
        if not where.exists():
            return cls(path, sha256)
        try:
            saved = json.loads(where.read_text())
            if saved.get("version") != CHECKPOINT_VERSION:
                raise ValueError(f"version {saved.get('version')}")
        except (OSError, ValueError) as exc:
            raise UsageError(f"the checkpoint {where} cannot be read ({exc}); remove it to "
                             "start over (nothing is submitted twice: each line's key is "
                             "the same)", code="invalid_checkpoint") from None
        if saved.get("sha256") != sha256:
            raise UsageError(f"the checkpoint {where} is of another content of the file "
                             f"(sha256 {str(saved.get('sha256'))[:12]}..., the file's is "
                             f"{sha256[:12]}...); remove it, or pass --checkpoint",
                             code="checkpoint_mismatch")
        return cls(path, sha256, next_line=int(saved["next_line"]),
                   counts=Counter(saved.get("counts", {})),
                   refused_by_code=Counter(saved.get("refused_by_code", {})),
                   problems=list(saved.get("problems", [])))


def _digest(path: Path) -> tuple[str, int]:
    """The file's SHA-256 and its number of lines."""
    digest, lines = hashlib.sha256(), 0
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
            lines += block.count(b"\n")
    if path.stat().st_size and not _ends_with_newline(path):
        lines += 1
    return digest.hexdigest(), lines


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


# (line number, the item's JSON as the file has it, with its key): sent as written, so the
# file's text is parsed once (to check it) and never encoded again.
Chunk = list[tuple[int, bytes]]


def _keyed(text: bytes, item: dict[str, Any], key: str) -> bytes:
    """The line's object with ``"idempotency_key": key`` as its first member when it has no
    key of its own (``item``: the line parsed; ``text``: the line, stripped, so ``{`` first).
    The API reads the same object as from the line re-encoded with the key: it hashes an
    item's canonical form (keys sorted), not its bytes."""
    if "idempotency_key" in item:
        return text
    member = b'{"idempotency_key":' + json.dumps(key).encode()
    return member + (b"," + text[1:] if item else b"}")


def _chunks(path: Path, first: int, size: int, key_prefix: str
            ) -> Iterator[tuple[int, Chunk, list[dict[str, Any]]]]:
    """From line ``first`` on: (the line after the chunk, [(line, item)], the bad lines
    among them). A blank line is skipped; a line that is not a JSON object is bad and not
    sent. The last chunk may hold bad lines only."""
    from calmq.storable import NonFiniteNumber, loads

    chunk: Chunk = []
    bad: list[dict[str, Any]] = []
    number = first - 1
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if number < first:
                continue
            text = raw.strip()
            if not text:
                continue
            try:
                item = loads(text.decode())
                if not isinstance(item, dict):
                    raise TypeError(f"a JSON {type(item).__name__}, not an object")
            except (NonFiniteNumber, ValueError, TypeError, UnicodeDecodeError) as exc:
                bad.append({"line": number, "code": "invalid_line", "detail": str(exc)[:300]})
                continue
            chunk.append((number, _keyed(text, item, f"{key_prefix}-{number}")))
            if len(chunk) >= size:
                yield number + 1, chunk, bad
                chunk, bad = [], []
    if chunk or bad:
        yield number + 1, chunk, bad


def _post(url: str, key: str, items: list[bytes], *, timeout: float = 120
          ) -> tuple[int, Any, float]:
    """(status, body, Retry-After seconds) of one POST /v1/jobs/bulk of ``items`` (each an
    item's JSON)."""
    data = b'{"jobs":[' + b",".join(items) + b"]}"
    req = urllib.request.Request(url, data=data, method="POST", headers={  # noqa: S310
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - our API
            return resp.status, json.loads(resp.read()), 0.0
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            parsed = json.loads(body or b"{}")
        except ValueError:
            parsed = {"detail": body[:300].decode("utf-8", "replace")}
        try:
            wait = float(exc.headers.get("Retry-After") or 0)
        except ValueError:
            wait = 0.0
        return exc.code, parsed, wait


def _send(url: str, key: str, items: list[bytes]) -> dict[str, Any]:
    """The chunk's answer, sent again while the API did not take it; every item has a key,
    so a repeat writes nothing twice."""
    pause = 0.5
    for attempt in range(1, _MAX_TRIES + 1):
        try:
            status, body, wait = _post(url, key, items)
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            if attempt == _MAX_TRIES:
                raise ConfigError(f"the API at {url} is not reachable ({exc}); run the same "
                                  "command again to resume", code="api_unreachable") from None
            status, body, wait = 0, {}, 0.0
        if status == 200:
            return dict(body)
        if status and status not in _RETRY_STATUSES:
            raise ConfigError(f"the API refused the chunk: {status} {body.get('code')}: "
                              f"{body.get('detail')}", code=str(body.get("code") or "http_error"))
        if attempt < _MAX_TRIES:
            time.sleep(max(wait, pause))  # a backoff between tries of one request
            pause = min(pause * 2, 10.0)
    raise ConfigError(f"the API kept refusing the chunk ({status}); run the same command "
                      "again to resume", code="api_unavailable")


def default_checkpoint(path: Path, sha256: str, configured_state_dir: str = "") -> Path:
    """Beside the file, where a resume finds it with no flag; where that folder cannot be
    written (a read-only mount in a pod), under the CLI's state folder (calmq.cli.bulk
    ``state_dir``), named by the file's content, so a resume of the same file finds it too."""
    beside = path.with_name(path.name + ".calmq-checkpoint.json")
    if beside.exists() or os.access(path.parent, os.W_OK):
        return beside
    from calmq.cli.bulk import state_dir

    return state_dir(configured_state_dir) / "submit" / f"{sha256[:32]}.json"


def run_file(*, api_url: str, api_key: str, path: Path, chunk_size: int,
             checkpoint: Path | None, max_chunks: int | None, fmt: Format,
             concurrency: int = 4, state_dir: str = "") -> int:
    """Submit every line of ``path``; print the summary; the exit code."""
    if not path.is_file():
        raise UsageError(f"--file {path}: no such file", code="file_not_found")
    if not 1 <= chunk_size <= 10_000:
        raise UsageError("--chunk-size is 1 to 10000 (the API's api_bulk_max_jobs bounds it)",
                         code="invalid_chunk_size")
    if not 1 <= concurrency <= 32:
        raise UsageError("--in-flight is 1 to 32", code="invalid_in_flight")
    sha256, total = _digest(path)
    where = checkpoint or default_checkpoint(path, sha256, state_dir)
    run = Backfill.resume(path, sha256, where)
    started_at = run.next_line
    key_prefix = f"file-{sha256[:32]}"
    tty = sys.stderr.isatty()
    progress = Progress("submitting", max(total, 1), out=sys.stderr, tty=tty)
    progress.n = run.next_line - 1
    started = time.monotonic()
    sent = chunks = 0
    stopped = False
    url = f"{api_url.rstrip('/')}/v1/jobs/bulk"
    # Chunks in flight at once: one request's validation in the API overlaps another's
    # transaction. Answers are taken in file order, so the checkpoint only ever moves over
    # a prefix of lines that were all answered.
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="calmq-submit")
    flight: deque[tuple[int, Chunk, list[dict[str, Any]], Future[dict[str, Any]] | None]] = (
        deque())

    def settle() -> None:
        nonlocal sent
        after, chunk, bad, future = flight.popleft()
        answer = future.result() if future is not None else {"results": []}
        run.counts["bad"] += len(bad)
        run.problems += bad
        for (line, _item), result in zip(chunk, answer["results"], strict=True):
            run.counts[result["status"]] += 1
            if result["status"] == "refused":
                problem = result.get("problem") or {}
                run.refused_by_code[str(problem.get("code"))] += 1
                run.problems.append({"line": line, "code": problem.get("code"),
                                     "detail": problem.get("detail")})
        run.next_line = after
        run.save(where)
        sent += len(chunk)
        progress.advance(after - 1 - progress.n)

    try:
        for after, chunk, bad in _chunks(path, run.next_line, chunk_size, key_prefix):
            if max_chunks is not None and chunks >= max_chunks:
                stopped = True
                break
            future = pool.submit(_send, url, api_key, [i for _, i in chunk]) if chunk else None
            chunks += 1 if chunk else 0
            flight.append((after, chunk, bad, future))
            while len(flight) >= concurrency:
                settle()
        while flight:
            settle()
    except KeyboardInterrupt:
        stopped = True
    finally:
        for *_rest, future in flight:
            if future is not None:
                future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        with contextlib.suppress(OSError):
            run.save(where)
    progress.finish()
    seconds = time.monotonic() - started
    summary = {
        "file": str(path), "checkpoint": str(where), "lines": total,
        "resumed_at_line": started_at if started_at > 1 else None,
        "next_line": run.next_line, "complete": not stopped,
        "accepted": run.counts["accepted"], "duplicate": run.counts["duplicate"],
        "refused": run.counts["refused"], "bad_lines": run.counts["bad"],
        "refused_by_code": dict(run.refused_by_code),
        "sent_this_run": sent, "chunks_this_run": chunks, "seconds": round(seconds, 3),
        "jobs_per_s": round(sent / seconds, 1) if seconds > 0 else 0.0,
        "problems": run.problems[:_BAD_LINES_SHOWN],
    }
    _print(summary, fmt)
    if stopped:
        return INTERRUPTED
    return int(Exit.PARTIAL) if run.counts["refused"] or run.counts["bad"] else int(Exit.OK)


def _print(summary: dict[str, Any], fmt: Format) -> None:
    if fmt in ("json", "jsonl"):
        print(json.dumps(summary, indent=2 if fmt == "json" else None))
        return
    state = "complete" if summary["complete"] else (
        f"stopped before line {summary['next_line']}: run the same command to resume")
    print(f"{summary['file']}: {state}")
    print(f"accepted {summary['accepted']}, duplicate {summary['duplicate']}, refused "
          f"{summary['refused']}, bad lines {summary['bad_lines']}; this run "
          f"{summary['sent_this_run']} in {summary['seconds']} s "
          f"({summary['jobs_per_s']} jobs/s)")
    for code, n in sorted(summary["refused_by_code"].items()):
        print(f"  refused {code}: {n}")
    for problem in summary["problems"]:
        print(f"  line {problem['line']}: {problem['code']}: {problem['detail']}")
