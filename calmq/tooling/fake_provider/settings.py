"""The fake provider's settings and the per-job modes it knows."""

from __future__ import annotations

from typing import Final

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from calmq.tooling.latency import parse_latency

__all__ = ["FAILURE_MODES", "MODES", "FakeProviderSettings"]

# The real providers' failures, served per job by `input.mode` (docs/reference/fake-provider.md):
# each answers with the status, error body and headers the real API sends.
FAILURE_MODES: Final[frozenset[str]] = frozenset(
    {
        "quota_exceeded",  # 429 insufficient_quota (OpenAI's billing error)
        "context_length",  # 400 context_length_exceeded
        "forbidden",  # 403 permission
        "model_not_found",  # 404 the model does not exist or the key cannot use it
        "too_large",  # 413 request too large
        "server_error",  # 500
        "overloaded",  # 529 overloaded_error (Anthropic; 503 in the OpenAI shape)
        "timeout",  # never answers within the step timeout (like slow, forever)
        "truncated",  # a 200 whose body is cut off mid-stream
        # Streamed calls (a whole answer otherwise): the first fail_times calls of the job
        # break off half way, the connection cut / with the provider's error event.
        "stream_break",
        "stream_error",
    }
)

_CLASSIC_MODES: Final[frozenset[str]] = frozenset(
    {
        "success",
        "slow",
        "malformed",
        "always_fail",
        "flaky",
        "rate_limited",
        "low_confidence",
        "refusal",
        "bad_request",
        "unauthorized",
        # a request the batch APIs' validation refuses: it fails its batch as a whole
        # (OpenAI: the batch ends ``failed`` naming its line; Anthropic: the create is
        # refused naming ``requests.N``); online it is a 400 like bad_request
        "invalid_line",
    }
)

MODES: Final[frozenset[str]] = _CLASSIC_MODES | FAILURE_MODES


class FakeProviderSettings(BaseModel):
    """How the fake provider behaves; every knob a test or benchmark needs to turn."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8090, ge=0, le=65535)
    requests_per_minute: int = Field(default=0, ge=0)  # 0 = unlimited
    tokens_per_minute: int = Field(default=0, ge=0)  # 0 = unlimited
    # Past the summarize step's 60 s timeout (the dev stack's default, no worker override):
    # a slow job times out on `calmq dev up` as it starts, as the reference table says.
    slow_seconds: float = Field(default=90.0, ge=0)
    retry_after_seconds: float = Field(default=1.0, ge=0)
    low_confidence: float = Field(default=0.42, ge=0, le=1)
    latency_ms: int = Field(default=0, ge=0)
    # A latency distribution (calmq/tooling/latency.py), e.g. lognormal:median=8s,p99=40s;
    # replaces latency_ms, so real calls' spread can be benchmarked, not only a fixed time.
    latency_dist: str = ""
    mode_override: str | None = None
    # The batch APIs: seconds from a batch's creation until it ends (POST /admin/batches).
    batch_completion_seconds: float = Field(default=2.0, ge=0)
    # Check every request against the official SDKs' request types and the providers'
    # documented rules (OpenAI's strict Structured Outputs), refusing what they refuse.
    check_requests: bool = True
    # Streamed answers: the time before the first token, and the pace after it (0: as fast
    # as the connection takes them); a call's input ttft_ms / tokens_per_second override.
    stream_ttft_ms: int = Field(default=0, ge=0)
    stream_tokens_per_second: float = Field(default=0.0, ge=0)
    # When set, every call must carry this key (Bearer, api-key or x-api-key), as a real
    # provider's 401 for a wrong key; empty: any key (or none) is taken.
    api_key: str = ""
    # OpenAI's flex tier (service_tier "flex"): its latency (None: four times the standard
    # latency of the call), and the share of flex calls refused for capacity (429).
    flex_latency_ms: int | None = Field(default=None, ge=0)
    flex_refusal_rate: float = Field(default=0.0, ge=0, le=1)
    # OpenAI caches every prompt of 1,024 tokens or more by itself; off, only requests that
    # carry prompt_cache_key (or prompt_cache_retention) are cached, so that runs without
    # it keep the answers (and bills) they had before caching was modelled.
    openai_automatic_cache: bool = False

    @field_validator("latency_dist")
    @classmethod
    def _known_latency(cls, value: str) -> str:
        if value:
            parse_latency(value)
        return value

    @model_validator(mode="after")
    def _one_latency(self) -> FakeProviderSettings:
        if self.latency_dist and self.latency_ms:
            raise ValueError("set --latency-ms or --latency-dist (latency_ms or latency_dist),"
                             " not both")
        return self

    @field_validator("mode_override")
    @classmethod
    def _known_mode(cls, value: str | None) -> str | None:
        if value is not None and value not in MODES:
            raise ValueError(f"unknown mode {value!r}; expected one of {sorted(MODES)}")
        return value

