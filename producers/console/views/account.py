"""Signing in and out."""

from __future__ import annotations

from aiohttp import web

from calmq.errors import ContractError
from calmq.producers.console.forms import text
from calmq.producers.console.session import (
    COOKIE,
    CSRF_COOKIE,
    Page,
    guard,
    new_login_token,
    redirect,
    safe_next,
    set_cookie,
    signed_in,
)
from calmq.producers.console.templates import render
from calmq.producers.console.views.common import Route

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
    if not await signed_in(request, key):
        return _sign_in_page(request, new_login_token(),
                             "that API key is unknown or revoked", 401)
    response = redirect(safe_next(request.query.get("next")))
    set_cookie(request, response, COOKIE, key)
    response.del_cookie(CSRF_COOKIE, path="/console/sign-in")
    return response


@guard()
async def sign_out(request: web.Request, page: Page) -> web.StreamResponse:
    response = redirect("/console/sign-in")
    response.del_cookie(COOKIE, path="/")
    return response


async def index(request: web.Request) -> web.StreamResponse:
    return redirect("/console/overview")


ROUTES: tuple[Route, ...] = (
    ("GET", "/console", index),
    ("GET", "/console/", index),
    ("GET", "/console/sign-in", sign_in_form),
    ("POST", "/console/sign-in", sign_in),
    ("POST", "/console/sign-out", sign_out),
)
