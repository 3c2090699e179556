"""The console's HTML: the page layout and small builders, as Python strings.

Every value that reaches a page goes through ``esc`` (``Markup`` marks text that is HTML
already), so a job's metadata or a model's output can never inject markup. No template
engine: the pages are few and small, and plain functions keep them typed.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

__all__ = ["Markup", "Page", "esc", "form", "layout", "table", "when"]


class Markup(str):
    """Text that is HTML already (built here from escaped parts)."""

    __slots__ = ()


def esc(value: Any) -> Markup:
    if isinstance(value, Markup):
        return value
    if value is None:
        return Markup("")
    if not isinstance(value, str):
        value = json.dumps(value, default=str) if isinstance(value, dict | list) else str(value)
    return Markup(html.escape(value, quote=True))


def join(parts: Iterable[str]) -> Markup:
    return Markup("".join(esc(p) for p in parts))


def when(at: datetime | None) -> Markup:
    """A time as a <time> element (UTC, to the second), or a dash."""
    if at is None:
        return Markup("&ndash;")
    text = at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return Markup(f'<time datetime="{esc(at.isoformat())}">{esc(text)}</time>')


def ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def table(caption: str, headers: Sequence[str], rows: Iterable[Sequence[Any]], *,
          empty: str = "nothing here", attrs: str = "") -> Markup:
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    if not body:
        body = f'<tr><td colspan="{len(headers)}" class="empty">{esc(empty)}</td></tr>'
    head = "".join(f'<th scope="col">{esc(h)}</th>' for h in headers)
    return Markup(f'<div class="scroll"><table {attrs}><caption>{esc(caption)}</caption>'
                  f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")


def form(action: str, csrf: str, inner: str, *, method: str = "post", attrs: str = "") -> Markup:
    """A form posting to the console, with its CSRF token."""
    token = f'<input type="hidden" name="csrf" value="{esc(csrf)}">' if method == "post" else ""
    return Markup(f'<form method="{method}" action="{esc(action)}" {attrs}>{token}{inner}</form>')


class Page:
    """Who is looking, for the layout: the key's tenant, roles, and whether it is a
    platform key (every page says so)."""

    def __init__(self, tenant: str, prefix: str, roles: Sequence[str], platform: bool,
                 csrf: str) -> None:
        self.tenant = tenant
        self.prefix = prefix
        self.roles = tuple(roles)
        self.platform = platform
        self.csrf = csrf


_NAV = (("overview", "Overview", None), ("jobs", "Jobs", None),
        ("reviews", "Reviews", "review"), ("dead-letters", "Dead letters", "operate"))


def layout(title: str, body: str, page: Page | None, *, current: str = "",
           status: str = "") -> str:
    """The whole document: header with navigation and who is signed in, then ``body``."""
    nav = ""
    banner = ""
    if page is not None:
        links = []
        for slug, label, role in _NAV:
            if role is not None and role not in page.roles:
                continue
            here = ' aria-current="page"' if slug == current else ""
            links.append(f'<li><a href="/console/{slug}"{here}>{label}</a></li>')
        sign_out = form("/console/sign-out", page.csrf,
                        '<button type="submit" class="link">Sign out</button>')
        scope = ("all tenants (platform key)" if page.platform else f"tenant {page.tenant}")
        nav = (f'<nav aria-label="Console"><ul>{"".join(links)}</ul></nav>'
               f'<div class="who"><span data-testid="who">{esc(scope)} &middot; key '
               f'{esc(page.prefix)} &middot; {esc(", ".join(page.roles))}</span>{sign_out}</div>')
        if page.platform:
            banner = ('<p class="platform" role="note" data-testid="platform-banner">'
                      "Platform key: you are seeing every tenant&rsquo;s jobs.</p>")
    live = f'<p id="status" role="status" aria-live="polite">{esc(status)}</p>'
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)} &middot; calmq console</title>"
        '<link rel="stylesheet" href="/console/static/console.css">'
        '<script src="/console/static/console.js" defer></script>'
        "</head><body>"
        '<a class="skip" href="#main">Skip to content</a>'
        f'<header><a class="brand" href="/console/overview">calmq</a>{nav}</header>'
        f'{banner}<main id="main" tabindex="-1"><h1>{esc(title)}</h1>{live}{body}</main>'
        "</body></html>"
    )
