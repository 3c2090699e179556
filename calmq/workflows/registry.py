"""Loading workflows: built-ins, the ``calmq.workflows`` entry point group, module paths.

An entry (an entry point's object, or a module's ``workflows`` or ``WORKFLOWS`` attribute)
may be a ``Workflow``, an iterable of them, or a callable returning either; a callable that
takes one argument receives the ``Settings``. The API and every worker call ``load`` with the
same settings, so they agree on names, steps and pools. Nothing is imported at import time.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from calmq.errors import ConfigError

if TYPE_CHECKING:
    from calmq.settings import Settings
    from calmq.workflows import Workflow

__all__ = ["ENTRY_POINT_GROUP", "collect", "load"]

ENTRY_POINT_GROUP = "calmq.workflows"


def collect(entry: Any, settings: Settings | None, origin: str) -> list[Workflow]:
    """The workflows an entry stands for."""
    from calmq.workflows import Workflow

    if isinstance(entry, Workflow):
        return [entry]
    if callable(entry):
        try:
            takes_settings = len(inspect.signature(entry).parameters) >= 1
        except (TypeError, ValueError):
            takes_settings = False
        return collect(entry(settings) if takes_settings else entry(), settings, origin)
    if isinstance(entry, Iterable) and not isinstance(entry, str | bytes | dict):
        found: list[Workflow] = []
        for item in entry:
            found.extend(collect(item, settings, origin))
        return found
    raise ConfigError(
        f"{origin} gave {type(entry).__name__}, not a Workflow, a list of them or a function "
        "returning them", code="invalid_workflow_entry",
    )


def _module_entry(path: str) -> Any:
    try:
        module = importlib.import_module(path)
    except ImportError as exc:
        raise ConfigError(f"cannot import workflow module {path!r}: {exc}",
                          code="invalid_workflow_module") from exc
    for attr in ("workflows", "WORKFLOWS"):
        if hasattr(module, attr):
            return getattr(module, attr)
    raise ConfigError(f"workflow module {path!r} has neither workflows() nor WORKFLOWS",
                      code="invalid_workflow_module")


def load(settings: Settings | None = None) -> dict[str, Workflow]:
    from calmq.workflows import builtin_workflows

    registry = dict(builtin_workflows(settings))
    sources: list[tuple[str, Any]] = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            sources.append((f"entry point {ep.name} ({ep.value})", ep.load()))
        except Exception as exc:
            raise ConfigError(f"cannot load workflow entry point {ep.name}: {exc}",
                              code="invalid_workflow_entry") from exc
    modules = settings.workflow_modules if settings is not None else ""
    for path in (p.strip() for p in modules.split(",")):
        if path:
            sources.append((f"module {path}", _module_entry(path)))
    for origin, entry in sources:
        for workflow in collect(entry, settings, origin):
            known = registry.get(workflow.name)
            if known is not None and known is not workflow:
                raise ConfigError(
                    f"workflow {workflow.name!r} from {origin} is registered already",
                    code="duplicate_workflow",
                )
            registry[workflow.name] = workflow
    return registry
