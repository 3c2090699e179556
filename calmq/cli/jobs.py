"""Jobs through the API: submit one, show one."""

from __future__ import annotations

import argparse
import json
from typing import Any

from calmq.cli.flags import Command, Flags, settings_for
from calmq.errors import ConfigError

__all__ = ["register"]


def _http(method: str, url: str, key: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={  # noqa: S310
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - our own API
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def cmd_submit(args: argparse.Namespace) -> int:
    settings = settings_for(args)
    if not args.api_key:
        raise ConfigError("pass --api-key or set CALMQ_API_KEY", code="missing_api_key")
    data = json.loads(args.input) if args.input else {"text": args.text or "", "mode": args.mode}
    status, body = _http("POST", f"{settings.api_url}/v1/jobs", args.api_key, {
        "workflow": args.workflow, "input": {k: v for k, v in data.items() if v is not None},
        "priority": args.priority})
    print(json.dumps(body, indent=2))
    return 0 if status == 202 else 1


def cmd_status(args: argparse.Namespace) -> int:
    settings = settings_for(args)
    if not args.api_key:
        raise ConfigError("pass --api-key or set CALMQ_API_KEY", code="missing_api_key")
    status, body = _http("GET", f"{settings.api_url}/v1/jobs/{args.job_id}", args.api_key)
    print(json.dumps(body, indent=2))
    return 0 if status == 200 else 1


def register(command: Command, flags: Flags) -> None:
    option = flags.option
    p = command("submit", cmd_submit, "submit a job through the API", needs=("api_url",))
    option(p, "--api-key", help="the tenant's API key")
    option(p, "--workflow", default="summarize", help="the workflow to run (default summarize)")
    option(p, "--priority", default="interactive", choices=["interactive", "bulk"],
           help="the job's priority")
    option(p, "--text", help="the input text")
    option(p, "--mode", help="the fake provider's mode for this job (success, flaky, ...)")
    option(p, "--input", help="the whole input as JSON")
    p = command("status", cmd_status, "show a job", needs=("api_url",))
    option(p, "--api-key", help="the tenant's API key")
    p.add_argument("job_id", help="the job's id")
