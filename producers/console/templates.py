"""The console's HTML: Jinja2 templates (producers/console/templates/), autoescaped.

Every value a template prints is escaped, in text and in attributes alike (``Markup`` marks
what is HTML already: the SVG charts, built from escaped parts), so a job's metadata or a
model's output can never inject markup. Pages extend ``base.html``; a table whose rows
refresh live renders them from one template, which both the page and its fragment route
include, so no script holds a second copy of a row.

Jinja2 directly, not aiohttp-jinja2: the helper adds a decorator and an application key
over these few lines, and has had no release since 1.6 (November 2023).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from functools import cache
from typing import Any

import jinja2
from aiohttp import web
from markupsafe import Markup, escape

__all__ = ["Markup", "ago", "environment", "fragment", "render", "when"]

# Headers of every console page: no caching of what a key may see, no framing, scripts and
# styles from the console itself only.
_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin"}


def when(at: datetime | None) -> Markup:
    """A time as a <time> element (UTC, to the second), or a dash."""
    if at is None:
        return Markup("&ndash;")
    text = at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return Markup('<time datetime="{}">{}</time>').format(at.isoformat(), text)


def ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _cell(value: Any) -> Any:
    """A table cell: a time as <time>, HTML built here as is, anything else as text."""
    if isinstance(value, datetime):
        return when(value)
    if isinstance(value, Markup):
        return value
    return _text(value)


def _text(value: Any) -> str:
    """A value as text: dicts and lists as JSON, None as nothing."""
    if value is None:
        return ""
    if isinstance(value, dict | list):
        return json.dumps(value, default=str)
    return str(value)


@cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("calmq.producers.console", "templates"),
        autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
        lstrip_blocks=True, auto_reload=False)
    from calmq.producers.console.shaping import event_summary

    env.filters.update(when=when, ago=ago, text=_text, cell=_cell, escape=escape,
                       summary=event_summary,
                       pretty=lambda v: json.dumps(v, indent=2, default=str))
    return env


def _html(template: str, context: dict[str, Any]) -> str:
    return environment().get_template(template).render(**context)


def render(template: str, status: int = 200, **context: Any) -> web.Response:
    """A whole page (a template that extends base.html)."""
    return web.Response(text=_html(template, context), status=status,
                        content_type="text/html", headers=_HEADERS)


def fragment(template: str, headers: dict[str, str] | None = None,
             **context: Any) -> web.Response:
    """Part of a page (rows of a table, items of a timeline) for a live refresh."""
    return web.Response(text=_html(template, context), content_type="text/html",
                        headers={**_HEADERS, **(headers or {})})
