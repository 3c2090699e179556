"""Helm and kustomize for the chart tests, as `make helm kustomize` builds them.

Both are built once from their Go modules with the machine's Go toolchain and cached per
user (like the Kafka jars): ``~/.cache/calmq/tools/<tool>-<version>/<tool>``. A tool found
there or on PATH is used; a missing one skips its tests, and fails them under CI=true.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

__all__ = ["HELM_VERSION", "KUSTOMIZE_VERSION", "tool"]

# The versions the Makefile builds (keep them in step with its helm and kustomize targets).
HELM_VERSION = "v4.3.2"
KUSTOMIZE_VERSION = "v5.8.1"
_VERSIONS = {"helm": HELM_VERSION, "kustomize": KUSTOMIZE_VERSION}


def _cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "calmq" / "tools"


def tool(name: str) -> str:
    """The path of ``helm`` or ``kustomize``; skips (CI: fails) when it is not built."""
    cached = _cache() / f"{name}-{_VERSIONS[name]}" / name
    if cached.is_file() and os.access(cached, os.X_OK):
        return str(cached)
    found = shutil.which(name)
    if found:
        return found
    message = (f"{name} {_VERSIONS[name]} is not built: `make {name}` builds it from its Go "
               f"module into {cached.parent}")
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)
