"""The intake side: the HTTP API and the client library that upstream services use."""

from calmq.producers.api import build_app

__all__ = ["build_app"]
