"""The model call's chain, composed in one place: for a process (the worker's provider, its
steps' allowed models, the batch lane's gate) and for an attempt (a key's rate limits and
the streamed-output publisher around the step's provider).

Innermost first: a provider's wire (calmq.calls.wires), the fleet's provider gate
(calmq.calls.gate), the budget, quota and meter (calmq.calls.budget), fallback across a
step's models (calmq.calls.fallback), the key's rate limits (calmq.calls.key_rates) and the
publisher (calmq.calls.publishing). The wrappers do not build each other: a new one is a
module of the package and a line here.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from calmq.calls.budget import BucketLimits, TokenBudget
from calmq.calls.budgeted_provider import BudgetedProvider
from calmq.calls.fallback import Fallback, allowed_models
from calmq.calls.gate import ProviderGate, provider_key
from calmq.calls.key_rates import Buckets, KeyRateLimiter
from calmq.calls.meter import UsageRecorder
from calmq.calls.publishing import OutputStream, PublishingProvider
from calmq.calls.quota import TenantQuota
from calmq.calls.tiers import chooser_for
from calmq.calls.wires import Provider, RateLimits, open_provider, wire
from calmq.data.budget import BudgetLedger, TenantTokenLedger
from calmq.data.providers import ProviderLedger
from calmq.errors import ConfigError

if TYPE_CHECKING:
    from calmq.data import Database
    from calmq.settings import Settings
    from calmq.workflows import KeyRateLimit, Workflow

__all__ = [
    "attempt_provider",
    "limits_from_settings",
    "open_gate",
    "open_metered_provider",
    "open_model",
    "open_step_models",
]

log = logging.getLogger(__name__)


def limits_from_settings(settings: Settings) -> BucketLimits:
    return BucketLimits(
        tokens_per_minute=settings.budget_tokens_per_minute,
        requests_per_minute=settings.budget_requests_per_minute,
        interactive_share=settings.budget_interactive_share,
        burst_seconds=settings.budget_burst_seconds,
        lease_seconds=settings.budget_lease_seconds,
    )


async def open_metered_provider(
    settings: Settings, db: Database, *, shared_budget: bool = True
) -> BudgetedProvider:
    """The worker's provider: the configured gateway, metered, under the fleet budget when
    ``budget_tokens_per_minute`` or ``budget_requests_per_minute`` is set (and
    ``shared_budget``; the benchmark's baseline turns it off), or once the provider's
    rate-limit headers state its limits (``provider_learn_limits``); behind the fleet's
    provider gate (blocks and rate-limit pauses, calmq.calls.gate). Embeddings go to the
    embeddings provider's own wrapper when it is another provider or model."""
    s = settings
    url = s.effective_provider_url
    inner = open_provider(s.provider, url, s.provider_api_key.get_secret_value(), s.model,
                          extra_headers=s.provider_extra_headers,
                          api_version=s.provider_api_version,
                          structured=s.structured_outputs,
                          retry_after_max=s.provider_retry_after_max_seconds)
    usage = UsageRecorder(db)
    usage.start()
    chat = await _metered(s, db, inner, kind=s.provider, url=url, model=s.model, usage=usage,
                          shared_budget=shared_budget, chat=True,
                          api_key=s.provider_api_key.get_secret_value())
    endpoint = s.embeddings_endpoint
    if endpoint is not None:
        kind, e_url, key, model, headers, version = endpoint
        if (kind, e_url.rstrip("/"), model) != (s.provider, url.rstrip("/"), s.model):
            e_inner = open_provider(kind, e_url, key, model, extra_headers=headers,
                                    api_version=version,
                                    retry_after_max=s.provider_retry_after_max_seconds)
            chat.embedder = await _metered(s, db, e_inner, kind=kind, url=e_url, model=model,
                                           usage=usage, shared_budget=shared_budget,
                                           chat=False, api_key=key)
            chat.embedder.owns_usage = False
    elif not wire(s.provider).embeddings:
        chat.embedder = None  # BudgetedProvider.embed: the wire's not_supported, named
    return chat


async def open_model(settings: Settings, db: Database, model: str, *,
                     usage: UsageRecorder | None, shared_budget: bool = True
                     ) -> BudgetedProvider:
    """Another chat model of the configured endpoint and key (a step's allowed model,
    calmq.calls.fallback), gated and metered like ``CALMQ_MODEL``: its own cooldowns and blocks,
    its own price, and a budget learned from the provider's headers (the configured budget
    is ``CALMQ_MODEL``'s). ``usage``: the worker's recorder, shared."""
    s = settings
    url = s.effective_provider_url
    key = s.provider_api_key.get_secret_value()
    inner = open_provider(s.provider, url, key, model, extra_headers=s.provider_extra_headers,
                          api_version=s.provider_api_version, structured=s.structured_outputs,
                          retry_after_max=s.provider_retry_after_max_seconds)
    recorder = usage or UsageRecorder(db)
    if usage is None:
        recorder.start()
    wrapped = await _metered(s, db, inner, kind=s.provider, url=url, model=model,
                             usage=recorder, shared_budget=shared_budget, chat=True,
                             api_key=key, configured=False)
    wrapped.owns_usage = usage is None
    return wrapped


async def _metered(settings: Settings, db: Database, inner: Any, *, kind: str, url: str,
                   model: str, usage: UsageRecorder, shared_budget: bool,
                   chat: bool, api_key: str, configured: bool | None = None
                   ) -> BudgetedProvider:
    s = settings
    # The bucket (and the gate) is per endpoint and model: two OpenAI-compatible servers
    # do not share a quota even when they serve the same model name.
    key = f"{kind}:{url.rstrip('/')}"
    budget: TokenBudget | None = None
    # The configured budget applies to the chat model; an embeddings model, or a step's
    # fallback model (calmq.calls.fallback), learns its own from the provider's headers.
    limits = (limits_from_settings(s) if (chat if configured is None else configured)
              else BucketLimits(0, 0))
    if shared_budget and (limits.tokens_per_minute or limits.requests_per_minute):
        budget = TokenBudget(BudgetLedger(db), key, model, limits,
                             slice_seconds=s.budget_slice_seconds)
        await budget.start()
    quota: TenantQuota | None = None
    if budget is not None and limits.tokens_per_minute:
        share = s.budget_tenant_share
        quota = TenantQuota(TenantTokenLedger(db),
                            int(limits.tokens_per_minute * share) if share < 1 else 0,
                            fleet_per_minute=limits.tokens_per_minute,
                            burst_seconds=s.budget_burst_seconds,
                            queue_seconds=s.budget_queue_seconds,
                            interactive_debt_seconds=s.budget_interactive_debt_seconds)

    async def probe() -> object:
        if chat:
            return await inner.complete(messages=[{"role": "user", "content": "ping"}],
                                        job_id="calmq-probe", max_tokens=1)
        return await inner.embed(inputs=["ping"], job_id="calmq-probe")

    gate = await open_gate(db, kind, url, api_key, model, probe=probe,
                           probe_seconds=s.provider_probe_seconds)

    async def learn(stated: RateLimits) -> TokenBudget | None:
        if not (shared_budget and s.provider_learn_limits):
            return None
        learned = BucketLimits(stated.tokens_per_minute or 0, stated.requests_per_minute or 0,
                               s.budget_interactive_share, s.budget_burst_seconds,
                               s.budget_lease_seconds)
        log.info("no budget set for %s: starting one from the provider's stated limits "
                 "(%d tokens, %d requests per minute)", model, learned.tokens_per_minute,
                 learned.requests_per_minute)
        made = TokenBudget(BudgetLedger(db), key, model, learned,
                           slice_seconds=s.budget_slice_seconds)
        await made.start()
        return made

    wrapped = BudgetedProvider(
        inner, provider=kind, model=model, budget=budget, usage=usage,
        prices=s.prices, counts_max_tokens=s.budget_counts_max_tokens,
        default_pause_seconds=s.budget_default_pause_seconds, quota=quota, gate=gate,
        learn_limits=learn if s.provider_learn_limits else None,
        prices_table=s.prices_table,
        tiers=chooser_for(s, kind, model) if chat else None)
    wrapped.show_configured()
    return wrapped


async def open_step_models(settings: Settings, db: Database,
                           workflows: Mapping[str, Workflow], default: BudgetedProvider
                           ) -> tuple[dict[tuple[str, str], Fallback], list[BudgetedProvider]]:
    """The providers of this worker's steps that name their allowed models (or a price
    ceiling), by (workflow, step), and the models opened for them besides ``default`` (the
    worker's ``CALMQ_MODEL``, which they share): the caller closes those."""
    opened: dict[str, BudgetedProvider] = {settings.model: default}
    routes: dict[tuple[str, str], Fallback] = {}
    for workflow in workflows.values():
        for step in workflow.steps:
            if workflow.pool_of(step) != settings.pool or (
                    not step.models and step.max_price_per_mtok is None):
                continue
            try:
                names = allowed_models(step.models, step.max_price_per_mtok,
                                       default=settings.model, prices=settings.prices,
                                       provider=settings.provider,
                                       table=settings.prices_table)
            except ConfigError as exc:
                raise ConfigError(f"workflow {workflow.name} step {step.name}: {exc.message}",
                                  code="invalid_workflow") from None
            for name in names:
                if name not in opened:
                    opened[name] = await open_model(settings, db, name, usage=default.usage)
            routes[(workflow.name, step.name)] = Fallback([opened[n] for n in names])
    return routes, [p for p in opened.values() if p is not default]


async def open_gate(db: Database, kind: str, url: str, api_key: str, model: str, *,
                    probe: Callable[[], Awaitable[object]], probe_seconds: float
                    ) -> ProviderGate:
    """The provider and model's fleet-wide gate, started: the worker's models and the batch
    lane share it by its key (kind, URL and API key), so a key refused in one blocks the
    other too; a ``probe`` call every ``probe_seconds`` lifts a block and releases the jobs
    that wait for it."""
    ledger = ProviderLedger(db)

    async def release() -> None:
        while await ledger.release_jobs():
            pass

    # A block or a pause names the key too: the provider's 429 is one key's quota.
    gate = ProviderGate(provider_key(kind, url, api_key), model, ledger=ledger, db=db,
                        probe=probe, probe_seconds=probe_seconds, on_unblocked=release)
    await gate.refresh()
    gate.start()
    return gate


def attempt_provider(base: Provider, output: OutputStream | None, *, stream_calls: bool,
                     buckets: Buckets | None, tenant_id: uuid.UUID | str, key: str | None,
                     scope: str, limit: KeyRateLimit | None) -> PublishingProvider:
    """The provider one attempt's step sees: ``base`` (the process's chain for the step)
    under the job's key rate limit when its workflow has one and the job a key (a call past
    it waits uncounted, calmq.calls.key_rates), its streamed text published to ``output``."""
    provider: Provider = base
    if buckets is not None and limit is not None and key:
        provider = KeyRateLimiter(base, buckets, tenant_id=tenant_id, key=key, scope=scope,
                                  limit=limit)
    return PublishingProvider(provider, output, stream_calls=stream_calls)
