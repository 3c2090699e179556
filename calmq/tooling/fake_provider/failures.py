"""The real providers' failures, as they answer them: status, error body and headers.

Each entry is what OpenAI (``{"error": {"message", "type", "param", "code"}}``) and
Anthropic (``{"type": "error", "error": {"type", "message"}}``) send for the same event, so
calmq's classification is tested against the bodies it meets in production.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

__all__ = ["FAILURES", "Failure", "anthropic_body", "openai_body", "retry_headers"]


@dataclass(frozen=True)
class Failure:
    """One failure in both shapes."""

    status: int
    openai_type: str
    openai_code: str | None
    openai_message: str
    anthropic_type: str
    anthropic_message: str
    anthropic_status: int | None = None  # when Anthropic answers another status
    openai_status: int | None = None
    openai_param: str | None = None


FAILURES: Final[dict[str, Failure]] = {
    "rate_limited": Failure(
        429, "requests", "rate_limit_exceeded",
        "Rate limit reached for requests per min (RPM) (simulated for this job). Please try "
        "again in {seconds}s.",
        "rate_limit_error", "Number of request tokens has exceeded your per-minute rate limit "
        "(simulated for this job)"),
    "quota_exceeded": Failure(
        429, "insufficient_quota", "insufficient_quota",
        "You exceeded your current quota, please check your plan and billing details.",
        "billing_error", "Your credit balance is too low to access the Anthropic API. Please "
        "go to Plans & Billing to upgrade or purchase credits.", anthropic_status=402),
    "context_length": Failure(
        400, "invalid_request_error", "context_length_exceeded",
        "This model's maximum context length is 128000 tokens. However, your messages "
        "resulted in 131072 tokens. Please reduce the length of the messages.",
        "invalid_request_error", "prompt is too long: 210000 tokens > 200000 maximum",
        openai_param="messages"),
    "unauthorized": Failure(
        401, "invalid_request_error", "invalid_api_key",
        "Incorrect API key provided: sk-fake***. You can find your API key at "
        "https://platform.openai.com/account/api-keys.",
        "authentication_error", "invalid x-api-key"),
    "forbidden": Failure(
        403, "invalid_request_error", "unsupported_country_region_territory",
        "You are not allowed to use this model with this key (simulated).",
        "permission_error", "Your API key does not have permission to use the specified "
        "resource."),
    "model_not_found": Failure(
        404, "invalid_request_error", "model_not_found",
        "The model `{model}` does not exist or you do not have access to it.",
        "not_found_error", "model: {model}"),
    "too_large": Failure(
        413, "invalid_request_error", "request_too_large",
        "Request too large: the body exceeds the maximum size.",
        "request_too_large", "Request exceeds the maximum allowed number of bytes."),
    "server_error": Failure(
        500, "server_error", None,
        "The server had an error while processing your request. Sorry about that!",
        "api_error", "Internal server error"),
    "always_fail": Failure(
        503, "server_error", "upstream_unavailable", "upstream_unavailable",
        "overloaded_error", "upstream_unavailable"),
    "overloaded": Failure(
        529, "server_error", None, "The engine is currently overloaded, please try again later",
        "overloaded_error", "Overloaded", openai_status=503),
    "bad_request": Failure(
        400, "invalid_request_error", "bad_request",
        "The request was rejected as invalid (simulated)",
        "invalid_request_error", "The request was rejected as invalid (simulated)"),
}

# POST /admin/outage: the statuses (and names) an incident may answer with.
OUTAGE_KINDS: Final[dict[int | str, str]] = {
    429: "rate_limited", 500: "server_error", 503: "always_fail", 529: "overloaded",
    401: "unauthorized", 403: "forbidden", 404: "model_not_found",
    "insufficient_quota": "quota_exceeded", "context_length_exceeded": "context_length",
}


def openai_body(failure: Failure, **fields: str) -> tuple[int, dict[str, Any]]:
    status = failure.openai_status or failure.status
    return status, {"error": {"message": failure.openai_message.format(**fields),
                              "type": failure.openai_type, "param": failure.openai_param,
                              "code": failure.openai_code}}


def anthropic_body(failure: Failure, request_id: str, **fields: str) -> tuple[int,
                                                                            dict[str, Any]]:
    status = failure.anthropic_status or failure.status
    return status, {"type": "error",
                    "error": {"type": failure.anthropic_type,
                              "message": failure.anthropic_message.format(**fields)},
                    "request_id": request_id}


def retry_headers(seconds: float, *, anthropic: bool) -> dict[str, str]:
    """OpenAI sends ``retry-after-ms`` (and ``retry-after``); Anthropic ``retry-after`` in
    whole seconds."""
    whole = str(max(1, round(seconds))) if seconds != int(seconds) else str(int(seconds))
    if anthropic:
        return {"retry-after": whole}
    return {"retry-after-ms": str(round(seconds * 1000)), "retry-after": whole}
