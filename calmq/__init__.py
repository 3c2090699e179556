"""calmq: slow AI steps out of the request, on Kafka and PostgreSQL.

The shared kernel: settings, the job model, the SQL store, Kafka wiring and topic names,
the Avro codec, the model gateway, workflows, the local dev stack and the CLI.
"""

from calmq.errors import CalmqError, ConfigError, ContractError, FailureClass, StepFailure
from calmq.jobs import EventType, Priority, Status
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

__version__ = "0.1.0"
