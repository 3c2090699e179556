"""Fake paid model provider: a real HTTP server speaking the OpenAI, Azure OpenAI and
Anthropic shapes.

Tests, the demo and benchmarks point calmq at this server instead of a paid API, so every
failure a real provider shows (5xx, 429, bad keys, exhausted quota, refusals, prose instead
of JSON, slowness) can be triggered deterministically, per job, from the step input itself.
The step input is the JSON object in the last user message, e.g. ``{"text": "...", "mode":
"flaky", "fail_times": 2, "delay_ms": 0}``. Every request is first checked against the
official SDKs' request types and the providers' documented rules, and refused as they
refuse it.

Modules: ``app`` (routes, serving, the command line), ``online`` (the model endpoints and
modes), ``batches`` (the batch APIs), ``conformance`` and ``sdk_types`` (what the real APIs
refuse), ``failures`` (their error bodies), ``limits`` (rate limits and their headers),
``calls`` (reading a call, building answers); latency models are calmq.tooling.latency.
"""

from calmq.tooling.fake_provider.app import build_app, main, serve
from calmq.tooling.fake_provider.settings import FAILURE_MODES, MODES, FakeProviderSettings

__all__ = ["FAILURE_MODES", "MODES", "FakeProviderSettings", "build_app", "main", "serve"]
