"""calmq: slow AI steps out of the request, on Kafka and PostgreSQL.

The shared kernel: settings, the job model, the data layer, Kafka wiring and topic names,
the Avro codec, the model gateway, workflows and the CLI. The tooling that production does
not run (fake provider, dev stack, demo, KEDA rendering, schema checks) is calmq.tooling.
"""

from typing import TYPE_CHECKING, Any

from calmq.errors import CalmqError, ConfigError, ContractError, FailureClass, StepFailure
from calmq.jobs import EventType, Priority, Status

if TYPE_CHECKING:
    from calmq.settings import Settings

__all__ = [
    "CalmqError",
    "ConfigError",
    "ContractError",
    "EventType",
    "FailureClass",
    "Priority",
    "Settings",
    "Status",
    "StepFailure",
]

# The one place the version is written: pyproject.toml reads it (tool.setuptools.dynamic).
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Settings loads pydantic-settings (about 0.25 s): only for those who ask for it, so
    # that importing any kernel module (the retry policy, the client) stays light.
    if name == "Settings":
        from calmq.settings import Settings

        return Settings
    raise AttributeError(f"module 'calmq' has no attribute {name!r}")
