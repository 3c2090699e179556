"""A model provider for unit tests that answers from a script (calmq.calls.wires.Provider)."""

from __future__ import annotations

from typing import Any

from calmq.calls.wires import ModelReply
from calmq.errors import StepFailure


class ScriptedProvider:
    """A Provider answering from a script: a reply or a StepFailure per call."""

    def __init__(self, *answers: ModelReply | StepFailure) -> None:
        self.answers = list(answers)
        self.calls = 0

    async def complete(self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
                       response_schema: dict[str, Any] | None = None) -> ModelReply:
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, StepFailure):
            raise answer
        return answer

    async def close(self) -> None:
        return None
