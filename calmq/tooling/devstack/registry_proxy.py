"""An authenticating HTTPS front for the dev stack's schema registry.

Why a proxy: Apicurio Registry 2.6 authenticates only through an OpenID Connect server
(Keycloak or Azure AD). Its "HTTP basic" option (``CLIENT_CREDENTIALS_BASIC_AUTH_ENABLED``)
does not check passwords itself: it trades the basic credentials for a token at that OIDC
server's client-credentials endpoint. Running an OIDC server in the dev stack would be a
second large JVM for one check, so the secured stack puts this small proxy in front of the
registry instead: TLS with the stack's CA, HTTP basic auth (or a bearer token) checked here,
then the request passed on to Apicurio on loopback. Clients see what a Confluent Cloud,
Aiven (Karapace) or nginx-fronted registry shows them: HTTPS and 401 without credentials.

Run: ``python -m calmq.tooling.devstack.registry_proxy --port P --upstream URL
[--upstream-ca PEM] --users FILE --cert PEM --key PEM [--tokens FILE]``; ``--users`` holds
``user:password`` lines and ``--tokens`` one bearer token a line (files, so no secret shows
in ``ps``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hmac
import ssl
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, web

__all__ = ["build_app", "main"]

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the proxy sets itself.
_DROP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                   "te", "trailer", "transfer-encoding", "upgrade", "host", "authorization",
                   "content-length"})


def _allowed(header: str, users: dict[str, str], tokens: list[str]) -> bool:
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "basic":
        try:
            user, _, password = base64.b64decode(value.strip()).decode("utf-8").partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        expected = users.get(user)
        return expected is not None and hmac.compare_digest(expected, password)
    if scheme.lower() == "bearer":
        return any(hmac.compare_digest(t, value.strip()) for t in tokens)
    return False


def build_app(upstream: str, users: dict[str, str], tokens: list[str],
              upstream_tls: ssl.SSLContext | None = None) -> web.Application:
    app = web.Application(client_max_size=16 * 1024 * 1024)
    session_key = web.AppKey("session", ClientSession)

    async def open_session(app: web.Application) -> None:
        app[session_key] = ClientSession(timeout=ClientTimeout(total=30),
                                         auto_decompress=False)

    async def close_session(app: web.Application) -> None:
        await app[session_key].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        if not _allowed(request.headers.get("Authorization", ""), users, tokens):
            return web.json_response(
                {"error_code": 401, "message": "Unauthorized"}, status=401,
                headers={"WWW-Authenticate": 'Basic realm="calmq dev registry"'})
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        body = await request.read()
        async with app[session_key].request(
                request.method, upstream.rstrip("/") + request.rel_url.raw_path_qs,
                headers=headers, data=body or None, allow_redirects=False,
                ssl=upstream_tls if upstream_tls is not None else True) as upstream_resp:
            payload = await upstream_resp.read()
            out = {k: v for k, v in upstream_resp.headers.items() if k.lower() not in _DROP}
            return web.Response(status=upstream_resp.status, body=payload, headers=out)

    app.router.add_route("*", "/{tail:.*}", forward)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    p.add_argument("--upstream-ca", type=Path, help="CA of an HTTPS upstream")
    p.add_argument("--users", type=Path, required=True)
    p.add_argument("--tokens", type=Path)
    p.add_argument("--cert", type=Path, required=True)
    p.add_argument("--key", type=Path, required=True)
    args = p.parse_args(argv)
    users = dict(line.split(":", 1) for line in args.users.read_text().splitlines()
                 if ":" in line)
    tokens = ([t.strip() for t in args.tokens.read_text().splitlines() if t.strip()]
              if args.tokens else [])
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(args.cert, args.key)
    upstream_tls = (ssl.create_default_context(cafile=str(args.upstream_ca))
                    if args.upstream_ca else None)
    asyncio.run(_serve(build_app(args.upstream, users, tokens, upstream_tls), args.port, tls))


async def _serve(app: web.Application, port: int, tls: ssl.SSLContext) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls).start()
    print(f"registry proxy listening on https://127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    main()
