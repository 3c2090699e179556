"""Tooling beside the kernel: what developers, tests, the demo and deployments use, and
production never runs.

The fake model provider, the local dev stack, the demo, KEDA manifest rendering and the
Avro compatibility checks. Nothing in the kernel or in producers, relay or processors
imports from here (an import-linter contract in pyproject.toml says so); the CLI does.
"""
