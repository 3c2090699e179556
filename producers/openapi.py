"""The OpenAPI document served at /openapi.json."""

from __future__ import annotations

from typing import Any

from producers.api import SubmitRequest

__all__ = ["document"]

_PROBLEM = {"$ref": "#/components/schemas/Problem"}


def _errors(*codes: int) -> dict[str, Any]:
    return {
        str(c): {"description": "problem", "content": {"application/problem+json": {"schema": _PROBLEM}}}
        for c in codes
    }


def document() -> dict[str, Any]:
    job_path = {"name": "job_id", "in": "path", "required": True,
                "schema": {"type": "string", "format": "uuid"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "calmq", "version": "1"},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "SubmitRequest": SubmitRequest.model_json_schema(),
                "Problem": {
                    "type": "object",
                    "required": ["type", "title", "status", "detail", "code"],
                    "properties": {k: {"type": "integer" if k == "status" else "string"}
                                   for k in ("type", "title", "status", "detail", "code")},
                },
            },
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/jobs": {"post": {
                "operationId": "submitJob",
                "parameters": [{"name": "Idempotency-Key", "in": "header", "required": False,
                                "schema": {"type": "string", "maxLength": 255}}],
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/SubmitRequest"}}}},
                "responses": {"202": {"description": "accepted"},
                              **_errors(400, 401, 409, 413, 415, 422)},
            }},
            "/v1/jobs/{job_id}": {"get": {
                "operationId": "getJob", "parameters": [job_path],
                "responses": {"200": {"description": "the job"}, **_errors(401, 404)},
            }},
            "/v1/jobs/{job_id}/cancel": {"post": {
                "operationId": "cancelJob", "parameters": [job_path],
                "responses": {"200": {"description": "cancelled"}, **_errors(401, 404, 409)},
            }},
            "/healthz": {"get": {"operationId": "healthz", "security": [],
                                 "responses": {"200": {"description": "alive"}}}},
            "/readyz": {"get": {"operationId": "readyz", "security": [],
                                "responses": {"200": {"description": "ready"}, **_errors(503)}}},
        },
    }
