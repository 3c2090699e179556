"""``calmq provider check|status|unblock|unpause``: the model providers as the fleet sees
them.

``check`` is the first command to run with a real key: one minimal call per configured
provider and model (the chat model, and the embeddings model), then it says whether the
credentials, the model and structured outputs work, whether the batch API answers, which
rate-limit headers came back and the limits they state, and the model's price. Exit 0 when
every check passed (an unpriced model is a warning), 1 when one failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from calmq.cli.connect import open_store
from calmq.cli.flags import Command, Flags, settings_for
from calmq.cli.output import Exit, add_output, emit_one, emit_rows, output_format
from calmq.errors import StepFailure

if TYPE_CHECKING:
    from calmq.calls.wires import RateLimits
    from calmq.settings import Settings

__all__ = ["CheckRow", "check_providers", "register"]

_TIMEOUT_SECONDS = 30.0


class _Probe(BaseModel):
    """The check's structured output: a tiny schema every provider's dialect can carry."""

    model_config = ConfigDict(extra="forbid")

    ok: bool
    note: str | None = None


@dataclass
class CheckRow:
    role: str  # chat, embeddings
    provider: str
    model: str
    check: str
    status: str  # ok, FAIL, warn, skip
    detail: str
    extra: dict[str, Any] = field(default_factory=dict)


def _failed(failure: StepFailure) -> str:
    return f"{failure.code}: {failure.message[:200]}"


async def _check_one(settings: Settings, *, role: str, kind: str, url: str, key: str,
                     model: str, headers: dict[str, str], version: str) -> list[CheckRow]:
    from calmq.calls.pricing import price_for, price_source
    from calmq.calls.wires import RateLimits, open_batch_client, open_provider

    rows: list[CheckRow] = []

    def row(check: str, status: str, detail: str, **extra: Any) -> None:
        rows.append(CheckRow(role, kind, model, check, status, detail, extra))

    provider = open_provider(kind, url, key, model, extra_headers=headers, api_version=version,
                             structured=settings.structured_outputs)
    seen: list[RateLimits] = []
    provider.observer = lambda _status, limits: seen.append(limits)
    schema = _Probe.model_json_schema()
    try:
        if role == "embeddings":
            try:
                async with asyncio.timeout(_TIMEOUT_SECONDS):
                    reply = await provider.embed(inputs=["calmq provider check"],
                                                 job_id="calmq-check")
                row("credentials", "ok", f"{url} answered with the configured key")
                row("model", "ok", f"{len(reply.vectors[0])} dimensions")
            except StepFailure as failure:
                _credential_rows(row, failure)
        else:
            try:
                async with asyncio.timeout(_TIMEOUT_SECONDS):
                    answer = await provider.complete(
                        messages=[{"role": "user", "content": 'Answer {"ok": true}.'}],
                        job_id="calmq-check", max_tokens=32, response_schema=schema)
                row("credentials", "ok", f"{url} answered with the configured key")
                row("model", "ok", f"{model} answered ({answer.input_tokens} input, "
                    f"{answer.output_tokens} output tokens)")
                how = ("schema (structured outputs)" if provider.schema_on
                       else "prompt only (CALMQ_STRUCTURED_OUTPUTS)")
                try:
                    json.loads(answer.content or "")
                    row("structured outputs", "ok", f"{how}: the answer is JSON")
                except ValueError:
                    row("structured outputs", "FAIL" if provider.schema_on else "warn",
                        f"{how}: the answer is not JSON: {(answer.content or '')[:80]!r}")
            except StepFailure as failure:
                _credential_rows(row, failure)
            except TimeoutError:
                row("credentials", "FAIL", f"no answer within {_TIMEOUT_SECONDS:g} s")
            row(*await _batch_row(open_batch_client(kind, url, key, model,
                                                    extra_headers=headers,
                                                    api_version=version)))
        stated = next((s for s in reversed(seen) if s.names), RateLimits())
        if stated.names:
            row("rate limits", "ok", f"{_per_minute(stated)}; headers: "
                f"{', '.join(stated.names)}", tokens_per_minute=stated.tokens_per_minute,
                requests_per_minute=stated.requests_per_minute)
        else:
            row("rate limits", "warn", "no rate-limit headers came back: the budget needs "
                "CALMQ_BUDGET_TOKENS_PER_MINUTE / _REQUESTS_PER_MINUTE set by hand")
        price = price_for(settings.prices, kind, model, table=settings.prices_table)
        source = price_source(settings.prices, kind, model, table=settings.prices_table)
        if price is None:
            row("price", "warn", f"UNPRICED: {model} costs 0 until CALMQ_PRICES names it")
        else:
            cached = (f", cached input {price.cached_input:g}" if price.cached_input
                      is not None else "")
            row("price", "ok", f"{price.input:g} in / {price.output:g} out USD per million "
                f"tokens{cached} ({source})")
    finally:
        await provider.close()
    return rows


def _per_minute(limits: RateLimits) -> str:
    parts = []
    if limits.tokens_per_minute is not None:
        parts.append(f"{limits.tokens_per_minute} tokens/min")
    if limits.requests_per_minute is not None:
        parts.append(f"{limits.requests_per_minute} requests/min")
    return ", ".join(parts) or "no limits stated"


def _credential_rows(row: Any, failure: StepFailure) -> None:
    if failure.code in ("provider_auth", "insufficient_quota"):
        row("credentials", "FAIL", _failed(failure))
    elif failure.code in ("model_not_found", "provider_permission"):
        row("credentials", "ok", "the key was taken")
        row("model", "FAIL", _failed(failure))
    elif failure.code == "provider_bad_request":
        row("credentials", "ok", "the key was taken")
        row("structured outputs", "FAIL", _failed(failure) + " (set CALMQ_STRUCTURED_OUTPUTS "
            "to prompt for this model if it does not take a schema)")
    else:
        row("credentials", "FAIL", _failed(failure))


async def _batch_row(client: Any) -> tuple[str, str, str]:
    path = client.batches_path
    try:
        async with asyncio.timeout(_TIMEOUT_SECONDS):
            await client._json("GET", path, params={"limit": "1"})
        return "batch API", "ok", f"GET {client.api.url(path)} answered"
    except Exception as exc:  # noqa: BLE001 - any failure is this check's answer
        return "batch API", "warn", f"unreachable (the batch lane needs it): {exc}"[:300]
    finally:
        await client.close()


async def check_providers(settings: Settings) -> list[CheckRow]:
    """Every configured provider and model, checked at once."""
    s = settings
    chat = _check_one(s, role="chat", kind=s.provider, url=s.effective_provider_url,
                      key=s.provider_api_key.get_secret_value(), model=s.model,
                      headers=dict(s.provider_extra_headers), version=s.provider_api_version)
    checks = [chat]
    endpoint = s.embeddings_endpoint
    if endpoint is not None:
        kind, url, key, model, headers, version = endpoint
        checks.append(_check_one(s, role="embeddings", kind=kind, url=url, key=key,
                                 model=model, headers=headers, version=version))
    rows = [r for found in await asyncio.gather(*checks) for r in found]
    if endpoint is None:
        rows.append(CheckRow("embeddings", s.provider, "", "embeddings", "warn",
                             f"{s.embeddings_provider or s.provider} has no embeddings API: "
                             "set CALMQ_EMBEDDINGS_PROVIDER for embed_document"))
    return rows


def cmd_check(args: argparse.Namespace) -> int:
    settings = settings_for(args)
    if not settings.effective_provider_url:
        from calmq.errors import ConfigError

        raise ConfigError("no provider to check: set CALMQ_PROVIDER_URL (and "
                          "CALMQ_PROVIDER_API_KEY), or CALMQ_FAKE_PROVIDER_URL",
                          code="no_provider")
    rows = asyncio.run(check_providers(settings))
    emit_rows([asdict(r) for r in rows], output_format(args),
              ["role", "provider", "model", "check", "status", "detail"])
    return Exit.ERROR if any(r.status == "FAIL" for r in rows) else Exit.OK


def cmd_status(args: argparse.Namespace) -> int:
    from calmq.data.providers import ProviderLedger

    settings = settings_for(args)

    async def read() -> tuple[list[Any], int]:
        async with open_store(settings, max_size=1) as store:
            ledger = ProviderLedger(store)
            return await ledger.states(), await ledger.waiting_jobs()

    states, waiting = asyncio.run(read())
    rows = [{**asdict(st), "state": ("BLOCKED" if st.blocked_reason else
                                     "paused" if st.paused_seconds > 0 else "ok")}
            for st in states]
    fmt = output_format(args)
    if fmt != "table":
        emit_one({"providers": rows, "jobs_waiting_for_a_provider": waiting}, fmt)
    else:
        emit_rows(rows, fmt, ["provider", "model", "state", "blocked_reason",
                              "paused_seconds", "observed_tokens_per_minute",
                              "observed_requests_per_minute", "blocked_message"],
                  empty="no provider has been called yet")
        print(f"\njobs waiting for a blocked provider: {waiting}")
    return Exit.ERROR if any(st.blocked_reason for st in states) else Exit.OK


def cmd_unblock(args: argparse.Namespace) -> int:
    from calmq.data.providers import ProviderLedger

    settings = settings_for(args)

    async def run() -> tuple[list[tuple[str, str]], int]:
        async with open_store(settings, max_size=2) as store:
            ledger = ProviderLedger(store)
            lifted = await ledger.unblock(args.provider_key or None,
                                          args.provider_model or None)
            released = 0
            while batch := await ledger.release_jobs():
                released += len(batch)
            return lifted, released

    lifted, released = asyncio.run(run())
    emit_one({"unblocked": [f"{p} {m}" for p, m in lifted], "jobs_released": released},
             output_format(args))
    return Exit.OK


def cmd_unpause(args: argparse.Namespace) -> int:
    from calmq.data.providers import ProviderLedger

    settings = settings_for(args)

    async def run() -> list[tuple[str, str, str]]:
        async with open_store(settings, max_size=1) as store:
            return await ProviderLedger(store).unpause(args.provider_key or None,
                                                       args.provider_model or None)

    lifted = asyncio.run(run())
    emit_one({"unpaused": [f"{p} {m}" for p, m, pause in lifted if pause == "provider"],
              "budgets_unpaused": [f"{p} {m}" for p, m, pause in lifted if pause == "budget"]},
             output_format(args))
    return Exit.OK


_ACTIONS = {"check": (cmd_check, ()), "status": (cmd_status, ("database_url",)),
            "unblock": (cmd_unblock, ("database_url",)),
            "unpause": (cmd_unpause, ("database_url",))}


def cmd_provider(args: argparse.Namespace) -> int:
    fn, needs = _ACTIONS[args.provider_action]
    args.needs = needs
    return fn(args)


def _target(parser: argparse.ArgumentParser, what: str) -> None:
    """PROVIDER and MODEL, named apart from the settings ``provider`` and ``model`` (every
    argument named as a setting is read as that setting: calmq.cli.flags.settings_for)."""
    parser.add_argument("provider_key", nargs="?", default=None, metavar="PROVIDER",
                        help="the provider key (kind:URL) as `status` shows it (default: "
                             f"every {what} one)")
    parser.add_argument("provider_model", nargs="?", default=None, metavar="MODEL",
                        help=f"the model (default: every {what} one)")


def register(command: Command, flags: Flags) -> None:
    p = command("provider", cmd_provider, "the model providers: check the configured key and "
                "models, show blocks and pauses, lift a block or a pause")
    sub = p.add_subparsers(dest="provider_action", required=True, metavar="ACTION",
                           help="check, status, unblock or unpause")
    check = sub.add_parser(
        "check", help="one minimal call per configured provider and model",
        description="one minimal call per configured provider and model (chat, embeddings): "
                    "credentials, model, structured outputs, batch API, rate-limit headers "
                    "and limits, price; exit 1 if a check failed")
    add_output(check)
    status = sub.add_parser(
        "status", help="each provider and model as the fleet sees it",
        description="each provider and model as the fleet sees it: blocked (why), paused "
                    "(how long), the limits its headers state; exit 1 if one is blocked")
    add_output(status)
    unblock = sub.add_parser(
        "unblock", help="lift a block at once and release the jobs waiting for it",
        description="lift a provider's block at once (without waiting for a probe call) "
                    "and release the jobs waiting for it")
    _target(unblock, "blocked")
    add_output(unblock)
    unpause = sub.add_parser(
        "unpause", help="lift a fleet-wide rate-limit pause at once",
        description="lift a provider and model's fleet-wide rate-limit pause (the "
                    "provider's Retry-After, and the token budget's pause of the same "
                    "endpoint and model) at once, without waiting for it to run out")
    _target(unpause, "paused")
    add_output(unpause)
