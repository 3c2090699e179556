"""Signing in and out."""

from __future__ import annotations

from aiohttp import web

from calmq.errors import ContractError
from calmq.producers.auth import check_unauthenticated, spend_unauthenticated
from calmq.producers.console.forms import text
from calmq.producers.console.session import (
    CSRF_COOKIE,
    Page,
    guard,
    new_login_token,
    open_session,
    redirect,
    safe_next,
    set_cookie,
    sign_out,
)
from calmq.producers.console.templates import render
from calmq.producers.console.views.common import Route
from calmq.producers.throttle import Throttled

__all__ = ["ROUTES"]


def _sign_in_page(request: web.Request, token: str, error: str = "", status: int = 200
                  ) -> web.Response:
    response = render("sign_in.html", status, title="Sign in", page=None, current="",
                      next=safe_next(request.query.get("next")), csrf=token, error=error)
    set_cookie(request, response, CSRF_COOKIE, token, path="/console/sign-in")
    return response


async def sign_in_form(request: web.Request) -> web.StreamResponse:
    return _sign_in_page(request, new_login_token())


async def sign_in(request: web.Request) -> web.StreamResponse:
    form = await request.post()
    token = request.cookies.get(CSRF_COOKIE, "")
    if not token or str(form.get("csrf", "")) != token:
        return _sign_in_page(request, new_login_token(),
                             "the sign-in form expired; try again", 403)
    try:
        key = text(form, "api_key", label="the API key")
    except ContractError as exc:
        return _sign_in_page(request, new_login_token(), exc.message, exc.status)
    response = redirect(safe_next(request.query.get("next")))
    try:
        # A sign-in with a made-up key spends its address's bucket, as an API request does
        # (producers/auth.py): the form is no way around the per-address limit.
        check_unauthenticated(request, key)
        if not key or not await open_session(request, response, key):
            spend_unauthenticated(request)
            return _sign_in_page(request, new_login_token(),
                                 "that API key is unknown or revoked", 401)
    except Throttled as exc:
        refused = _sign_in_page(request, new_login_token(), exc.message, exc.status)
        refused.headers["Retry-After"] = exc.retry_after_header
        return refused
    response.del_cookie(CSRF_COOKIE, path="/console/sign-in")
    return response


@guard()
async def leave(request: web.Request, page: Page) -> web.StreamResponse:
    response = redirect("/console/sign-in")
    await sign_out(request, response)
    return response


async def index(request: web.Request) -> web.StreamResponse:
    return redirect("/console/overview")


ROUTES: tuple[Route, ...] = (
    ("GET", "/console", index),
    ("GET", "/console/", index),
    ("GET", "/console/sign-in", sign_in_form),
    ("POST", "/console/sign-in", sign_in),
    ("POST", "/console/sign-out", leave),
)
