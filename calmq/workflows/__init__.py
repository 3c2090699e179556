"""Workflows: named, versioned lists of steps. A step is a plain async function.

The business function stays testable alone: it receives a ``StepContext`` (the model
gateway, the job's identity, an idempotency key) and its input, and returns its output
model; it knows nothing of Kafka or the database.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from calmq.errors import ContractError
from calmq.gateway import Provider

__all__ = ["Step", "StepContext", "StepOutput", "Workflow", "builtin_workflows", "find_workflow"]


@dataclass(frozen=True)
class StepContext:
    job_id: str
    tenant_id: str
    step: str
    attempt: int
    provider: Provider

    @property
    def idempotency_key(self) -> str:
        """Stable across attempts of this step: hand it to external systems."""
        return f"{self.job_id}:{self.step}"


@dataclass(frozen=True)
class StepOutput:
    """What a step produced: the artifact to store, and the model's confidence if any."""

    artifact: dict[str, Any]
    confidence: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0


StepFunction = Callable[[StepContext, dict[str, Any]], Awaitable[StepOutput]]


@dataclass(frozen=True)
class Step:
    name: str
    run: StepFunction
    timeout_seconds: float = 60.0
    max_attempts: int = 3
    pool: str | None = None  # None: the workflow's pool


@dataclass(frozen=True)
class Workflow:
    name: str
    version: int
    input_model: type[BaseModel]
    steps: tuple[Step, ...]
    pool: str = "default"
    review_threshold: float | None = 0.9
    meta: dict[str, Any] = field(default_factory=dict)

    def step(self, name: str) -> Step:
        for step in self.steps:
            if step.name == name:
                return step
        raise ContractError(f"workflow {self.name} v{self.version} has no step {name!r}",
                            code="unknown_step")

    def validate_input(self, raw: Any) -> dict[str, Any]:
        from pydantic import ValidationError

        try:
            return self.input_model.model_validate(raw).model_dump(exclude_none=True)
        except ValidationError as exc:
            problems = "; ".join(
                f"input.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
            )
            raise ContractError(
                f"input does not fit workflow {self.name}: {problems}",
                code="invalid_input", status=422,
            ) from exc


def builtin_workflows() -> dict[str, Workflow]:
    from calmq.workflows.summarize import SUMMARIZE

    return {SUMMARIZE.name: SUMMARIZE}


def find_workflow(name: str, registry: dict[str, Workflow] | None = None) -> Workflow:
    workflows = registry if registry is not None else builtin_workflows()
    try:
        return workflows[name]
    except KeyError:
        raise ContractError(
            f"unknown workflow {name!r}; known: {', '.join(sorted(workflows))}",
            code="unknown_workflow", status=422,
        ) from None
