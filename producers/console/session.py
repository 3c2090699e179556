"""Signing in to the console: a session cookie, CSRF tokens, and the page guard.

Signing in with an API key opens a session (calmq.data.tenants: a random token, stored
only as its hash, tied to the key, ending after ``console_session_seconds``); the cookie
holds that token, never the key (HttpOnly: no script reads it; SameSite=Strict: no other
site's page sends it; Secure when the request came over HTTPS; Max-Age the session's
length). A session ends at its expiry, at sign-out (in every API process at once), and
when its key is revoked. Every form carries a CSRF token derived from the session token (a
page of another origin cannot read it); the sign-in form, before there is a session, uses
a random token in a cookie of its own (double submit). Every page spends the key's token
bucket, as every /v1 call does (``api_rate_per_second``): past it, a 429 page with
``Retry-After``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from calmq.data import Tenant
from calmq.errors import ContractError
from calmq.producers.auth import COOKIE, forget_session, limit, session_tenant
from calmq.producers.console.templates import render
from calmq.producers.context import SETTINGS, STORE
from calmq.producers.throttle import Throttled

__all__ = ["COOKIE", "CSRF_COOKIE", "Handler", "Page", "csrf_token", "guard",
           "new_login_token", "open_session", "redirect", "set_cookie", "sign_out"]

CSRF_COOKIE = "calmq_console_csrf"

_NAV = (("overview", "Overview", None), ("jobs", "Jobs", None),
        ("reviews", "Reviews", "review"), ("dead-letters", "Dead letters", "operate"))


@dataclass(frozen=True, slots=True)
class Page:
    """Who is looking, as the views and the layout need it: the key's tenant, roles, whether
    it is a platform key (every page says so), and the CSRF token of its forms."""

    tenant: str
    tenant_id: uuid.UUID
    prefix: str
    roles: tuple[str, ...]
    platform: bool
    csrf: str
    identity: str  # who did it, in the history: ``tenant <name> key <prefix>``

    def can(self, role: str) -> bool:
        return role in self.roles

    @property
    def scope(self) -> uuid.UUID | None:
        """The tenant the console reads: its own, or None (every tenant) for a platform
        key."""
        return None if self.platform else self.tenant_id

    @property
    def nav(self) -> list[tuple[str, str]]:
        return [(slug, label) for slug, label, role in _NAV
                if role is None or role in self.roles]

    @property
    def who(self) -> str:
        scope = "all tenants (platform key)" if self.platform else f"tenant {self.tenant}"
        return f"{scope} \u00b7 key {self.prefix} \u00b7 {', '.join(self.roles)}"

    @classmethod
    def of(cls, caller: Tenant, session: str) -> Page:
        return cls(caller.name, caller.id, caller.key_prefix, tuple(caller.roles),
                   caller.platform, csrf_token(session), caller.identity)


Handler = Callable[[web.Request, Page], Awaitable[web.StreamResponse]]


def csrf_token(session: str) -> str:
    """The CSRF token of a session's forms: a hash only the session's holder can make."""
    return hashlib.sha256(b"calmq console csrf\0" + session.encode()).hexdigest()


def _same_token(sent: object, expected: str) -> bool:
    """Compared as bytes: ``hmac.compare_digest`` refuses str with non-ASCII characters
    (a form field may hold any), which was a 500."""
    return hmac.compare_digest(str(sent).encode("utf-8", "replace"), expected.encode())


def new_login_token() -> str:
    return secrets.token_urlsafe(24)


def set_cookie(request: web.Request, response: web.StreamResponse, name: str, value: str,
               *, path: str = "/", max_age: int | None = None) -> None:
    secure = request.secure or request.headers.get("X-Forwarded-Proto") == "https"
    response.set_cookie(name, value, path=path, httponly=True, samesite="Strict",
                        secure=secure, max_age=max_age)


async def open_session(request: web.Request, response: web.StreamResponse, key: str
                       ) -> bool:
    """Sign ``key`` in: a new session, its token in the cookie; False (nothing set) when
    the key is unknown or revoked."""
    seconds = request.app[SETTINGS].console_session_seconds
    token = await request.app[STORE].tenants.open_session(key, seconds)
    if token is None:
        return False
    set_cookie(request, response, COOKIE, token, max_age=int(seconds))
    return True


async def sign_out(request: web.Request, response: web.StreamResponse) -> None:
    """End the request's session everywhere and forget its cookie."""
    token = request.cookies.get(COOKIE, "")
    if token:
        await request.app[STORE].tenants.close_session(token)
        forget_session(request, token)
    response.del_cookie(COOKIE, path="/")


def redirect(location: str) -> web.Response:
    # A 303 answer, not a raised HTTPFound: the API's error middleware turns raised HTTP
    # exceptions into problem+json.
    return web.Response(status=303, headers={"Location": location})


def _same_origin(request: web.Request) -> bool:
    origin = request.headers.get("Origin")
    if origin is None or origin == "null":
        return origin is None
    return origin.split("://", 1)[-1] == request.host


def error_page(request: web.Request, page: Page | None, status: int, code: str,
               message: str) -> web.StreamResponse:
    if request.path.endswith(".json"):
        from calmq.producers.problems import problem

        return problem(status, code, message,
                       base=request.app[SETTINGS].api_problem_base_url)
    return render("error.html", status, title=f"Error {status}", page=page, current="",
                  code=code, message=message)


def guard(*roles: str) -> Callable[[Handler], Callable[[web.Request],
                                                       Awaitable[web.StreamResponse]]]:
    """A console handler: signed in (else to the sign-in page), a POST with its CSRF token,
    the key holding one of ``roles``; a ContractError becomes an error page."""

    def wrap(handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def run(request: web.Request) -> web.StreamResponse:
            token = request.cookies.get(COOKIE, "")
            caller = await session_tenant(request, token)
            if caller is None:
                if request.path.endswith(".json"):
                    return error_page(request, None, 401, "not_signed_in",
                                      "sign in at /console/sign-in")
                target = request.path_qs if request.method == "GET" else "/console/overview"
                response = redirect("/console/sign-in?next=" + _quote(target))
                if token:  # an ended session: forget it
                    response.del_cookie(COOKIE, path="/")
                return response
            page = Page.of(caller, token)
            try:
                limit(request, caller)
            except Throttled as exc:
                refused = error_page(request, page, exc.status, exc.code, exc.message)
                refused.headers["Retry-After"] = exc.retry_after_header
                return refused
            if request.method == "POST":
                form = await request.post()
                if not (_same_origin(request) and _same_token(form.get("csrf", ""),
                                                              page.csrf)):
                    return error_page(request, page, 403, "csrf_failed",
                                      "the form's CSRF token is missing or stale; reload "
                                      "the page and try again")
            if roles and not any(page.can(r) for r in roles):
                return error_page(request, page, 403, "role_forbidden",
                                  f"this needs the {' or '.join(roles)} role; your key has "
                                  f"{', '.join(page.roles)}")
            try:
                return await handler(request, page)
            except ContractError as exc:
                answer = error_page(request, page, exc.status, exc.code, exc.message)
                if isinstance(exc, Throttled):  # a read gate's refusal: when to come back
                    answer.headers["Retry-After"] = exc.retry_after_header
                return answer

        return run

    return wrap


def _quote(path: str) -> str:
    from urllib.parse import quote

    return quote(path, safe="")


def safe_next(value: str | None) -> str:
    """Where to go after signing in: a console path only (no open redirect)."""
    if value and value.startswith("/console/") and not value.startswith("//"):
        return value
    return "/console/overview"
