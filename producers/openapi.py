"""The OpenAPI document served at /openapi.json, written by hand next to producers.api.ROUTES.

tests/unit/test_api_openapi.py fails when a route is added to the API without a path here
(or the reverse), so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from calmq.jobs import Status
from calmq.producers.api import RedriveRequest, ReviewRequest, SubmitRequest

__all__ = ["document"]

_PROBLEM = {"$ref": "#/components/schemas/Problem"}
_JSON = "application/json"


def _errors(*codes: int) -> dict[str, Any]:
    return {
        str(c): {"description": "problem",
                 "content": {"application/problem+json": {"schema": _PROBLEM}}}
        for c in codes
    }


def _ok(description: str, ref: str | None = None, content_type: str = _JSON) -> dict[str, Any]:
    if ref is None:
        return {"description": description}
    return {"description": description,
            "content": {content_type: {"schema": {"$ref": f"#/components/schemas/{ref}"}}}}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _schemas() -> dict[str, Any]:
    statuses = [s.value for s in Status]
    summary_props: dict[str, Any] = {
        "job_id": {"type": "string", "format": "uuid"},
        "workflow": {"type": "string"},
        "status": {"type": "string", "enum": statuses},
        "attempt": {"type": "integer"},
        "step": {"type": "string"},
        "artifact": _nullable({"type": "object", "required": ["uri", "sha256", "content_type",
                                                              "size"]}),
        "error": _nullable({"type": "object", "required": ["code", "class", "message"]}),
        "created_at": {"type": "string", "format": "date-time"},
        "updated_at": {"type": "string", "format": "date-time"},
    }
    event = {"type": "object", "required": ["type", "at", "attempt", "detail"],
             "properties": {"type": {"type": "string"},
                            "at": {"type": "string", "format": "date-time"},
                            "attempt": {"type": "integer"}, "detail": {"type": "object"}}}
    return {
        "SubmitRequest": SubmitRequest.model_json_schema(),
        "ReviewRequest": ReviewRequest.model_json_schema(),
        "RedriveRequest": RedriveRequest.model_json_schema(),
        "DeadLetters": {"type": "object", "required": ["dead_letters"], "properties": {
            "dead_letters": {"type": "array", "items": {
                "type": "object",
                "required": ["job_id", "workflow", "step", "attempt", "error", "created_at",
                             "dead_lettered_at", "redrive_url"],
                "properties": {"job_id": {"type": "string", "format": "uuid"},
                               "workflow": {"type": "string"}, "step": {"type": "string"},
                               "attempt": {"type": "integer"},
                               "error": _nullable({"type": "object"}),
                               "created_at": {"type": "string", "format": "date-time"},
                               "dead_lettered_at": {"type": "string", "format": "date-time"},
                               "redrive_url": {"type": "string"}}}}}},
        "Reviews": {"type": "object", "required": ["reviews"], "properties": {"reviews": {
            "type": "array", "items": {
                "type": "object",
                "required": ["job_id", "workflow", "step", "confidence", "output",
                             "requested_at", "deadline_at", "review_url"],
                "properties": {"job_id": {"type": "string", "format": "uuid"},
                               "workflow": {"type": "string"}, "step": {"type": "string"},
                               "confidence": _nullable({"type": "number"}),
                               "output": {"type": "object"},
                               "requested_at": {"type": "string", "format": "date-time"},
                               "deadline_at": _nullable({"type": "string",
                                                         "format": "date-time"}),
                               "review_url": {"type": "string"}}}}}},
        "Accepted": {"type": "object", "required": ["job_id", "status", "status_url"],
                     "properties": {"job_id": {"type": "string", "format": "uuid"},
                                    "status": {"const": "queued"},
                                    "status_url": {"type": "string"}}},
        "JobSummary": {"type": "object", "required": list(summary_props),
                       "properties": summary_props},
        "Job": {"type": "object", "required": [*summary_props, "events"],
                "properties": {**summary_props, "events": {"type": "array", "items": event},
                               # Tokens and cost of every attempt so far (retries included).
                               "usage": {"type": "object", "properties": {
                                   "input_tokens": {"type": "integer"},
                                   "output_tokens": {"type": "integer"},
                                   "cost_usd": {"type": "number"}}}}},
        "JobList": {"type": "object", "required": ["jobs", "next_cursor"],
                    "properties": {"jobs": {"type": "array",
                                            "items": {"$ref": "#/components/schemas/JobSummary"}},
                                   "next_cursor": _nullable({"type": "string"})}},
        "Problem": {
            "type": "object",
            "required": ["type", "title", "status", "detail", "code"],
            "properties": {k: {"type": "integer" if k == "status" else "string"}
                           for k in ("type", "title", "status", "detail", "code")},
        },
    }


def document() -> dict[str, Any]:
    job_path = {"name": "job_id", "in": "path", "required": True,
                "schema": {"type": "string", "format": "uuid"}}
    multipart = {"type": "object", "required": ["workflow", "file"], "properties": {
        "workflow": {"type": "string"}, "file": {"type": "string", "format": "binary"},
        "priority": {"type": "string", "enum": ["interactive", "bulk"]},
        "deadline_seconds": {"type": "string", "description": "an integer"},
        "callback_url": {"type": "string"},
        "metadata": {"type": "string", "description": "a JSON object"}}}
    no_auth: list[dict[str, list[str]]] = []
    return {
        "openapi": "3.1.0",
        "info": {"title": "calmq", "version": "1",
                 "description": "Intake API of calmq; see docs/reference/api.md."},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": _schemas(),
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/jobs": {
                "post": {
                    "operationId": "submitJob",
                    "parameters": [
                        {"name": "Idempotency-Key", "in": "header", "required": False,
                         "schema": {"type": "string", "minLength": 1, "maxLength": 255}}],
                    "requestBody": {"required": True, "content": {
                        _JSON: {"schema": {"$ref": "#/components/schemas/SubmitRequest"}},
                        "multipart/form-data": {"schema": multipart}}},
                    "responses": {"202": _ok("accepted", "Accepted"),
                                  **_errors(400, 401, 403, 409, 413, 415, 422, 503)},
                },
                "get": {
                    "operationId": "listJobs",
                    "parameters": [
                        {"name": "status", "in": "query", "required": False,
                         "schema": {"type": "string"},
                         "description": "one status or a comma list: " + ", ".join(
                             s.value for s in Status)},
                        {"name": "workflow", "in": "query", "required": False,
                         "schema": {"type": "string"}},
                        {"name": "created_after", "in": "query", "required": False,
                         "schema": {"type": "string", "format": "date-time"}},
                        {"name": "created_before", "in": "query", "required": False,
                         "schema": {"type": "string", "format": "date-time"}},
                        {"name": "limit", "in": "query", "required": False,
                         "schema": {"type": "integer", "minimum": 1, "maximum": 200}},
                        {"name": "cursor", "in": "query", "required": False,
                         "schema": {"type": "string"}}],
                    "responses": {"200": _ok("a page of jobs, newest first", "JobList"),
                                  **_errors(400, 401)},
                },
            },
            "/v1/jobs/{job_id}": {
                "get": {"operationId": "getJob", "parameters": [job_path],
                        "responses": {"200": _ok("the job", "Job"), **_errors(401, 404)}},
                "delete": {"operationId": "deleteJob", "parameters": [job_path],
                           "responses": {"204": _ok("objects purged, record redacted"),
                                         **_errors(401, 404, 409)}},
            },
            "/v1/jobs/{job_id}/events": {"get": {
                "operationId": "jobEvents", "parameters": [
                    job_path,
                    {"name": "Last-Event-ID", "in": "header", "required": False,
                     "schema": {"type": "string"}}],
                "responses": {"200": {"description": "server-sent events",
                                      "content": {"text/event-stream": {}}},
                              **_errors(400, 401, 404)},
            }},
            "/v1/jobs/{job_id}/artifact": {"get": {
                "operationId": "getArtifact", "parameters": [job_path],
                "responses": {"200": {"description": "the artifact's bytes"},
                              **_errors(401, 404)},
            }},
            "/v1/jobs/{job_id}/cancel": {"post": {
                "operationId": "cancelJob", "parameters": [job_path],
                "responses": {"200": _ok("cancelled", "Job"), **_errors(401, 404, 409)},
            }},
            "/v1/jobs/{job_id}/review": {"post": {
                "operationId": "reviewJob", "parameters": [job_path],
                "requestBody": {"required": True, "content": {_JSON: {
                    "schema": {"$ref": "#/components/schemas/ReviewRequest"}}}},
                "responses": {"200": _ok("decided", "Job"), **_errors(401, 404, 409, 415, 422)},
            }},
            "/v1/reviews": {"get": {
                "operationId": "listReviews",
                "parameters": [{"name": "limit", "in": "query", "required": False,
                                "schema": {"type": "integer", "minimum": 1, "maximum": 200}}],
                "responses": {"200": _ok("jobs awaiting review, oldest first", "Reviews"),
                              **_errors(401, 422)},
            }},
            "/v1/dead-letters": {"get": {
                "operationId": "listDeadLetters",
                "parameters": [
                    *({"name": n, "in": "query", "required": False, "schema": {"type": "string"}}
                      for n in ("failure_class", "code", "workflow")),
                    *({"name": n, "in": "query", "required": False,
                       "schema": {"type": "string", "format": "date-time"}}
                      for n in ("since", "until")),
                    {"name": "limit", "in": "query", "required": False,
                     "schema": {"type": "integer", "minimum": 1, "maximum": 200}}],
                "responses": {"200": _ok("dead-lettered jobs, oldest death first",
                                         "DeadLetters"), **_errors(401, 422)},
            }},
            "/v1/dead-letters/{job_id}/redrive": {"post": {
                "operationId": "redriveDeadLetter", "parameters": [job_path],
                "requestBody": {"required": True, "content": {_JSON: {
                    "schema": {"$ref": "#/components/schemas/RedriveRequest"}}}},
                "responses": {"200": _ok("requeued (or, with dry_run, unchanged)", "Job"),
                              **_errors(401, 404, 409, 415, 422)},
            }},
            "/healthz": {"get": {"operationId": "healthz", "security": no_auth,
                                 "responses": {"200": {"description": "alive"}}}},
            "/readyz": {"get": {"operationId": "readyz", "security": no_auth,
                                "responses": {"200": {"description": "ready"}, **_errors(503)}}},
            "/metrics": {"get": {"operationId": "metrics", "security": no_auth,
                                 "responses": {"200": {"description": "Prometheus text"}}}},
            "/openapi.json": {"get": {"operationId": "openapi", "security": no_auth,
                                      "responses": {"200": {"description": "this document"}}}},
        },
    }
