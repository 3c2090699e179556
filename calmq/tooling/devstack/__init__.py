"""The local development stack: real Kafka, real PostgreSQL and calmq's own services."""

from calmq.tooling.devstack.stack import (
    SERVICES,
    Part,
    Stack,
    StackState,
    default_data_dir,
    require_state,
)

__all__ = ["SERVICES", "Part", "Stack", "StackState", "default_data_dir", "require_state"]
