"""Pure rules of the intake API: tenant prefixes, callback targets, webhook signatures."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from calmq.errors import ContractError
from calmq.producers.uploads import tenant_owns
from calmq.producers.webhooks import (
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    check_callback_url,
    sign,
    verify,
)

T = uuid.UUID("11111111-1111-1111-1111-111111111111")
BASE = "file:///srv/objects"


@pytest.mark.parametrize(("ref", "owned"), [
    (f"{BASE}/{T}/inputs/a.txt", True),
    (f"{BASE}/{T}/deep/er/b", True),
    (f"{BASE}/{T}", False),
    (f"{BASE}/{T}/", False),
    (f"{BASE}/{T}/../{uuid.uuid4()}/x", False),
    (f"{BASE}/{T}/%2e%2e/x", False),
    (f"{BASE}/{T}/a/./b", False),
    (f"{BASE}/{T}x/a", False),
    (f"{BASE}/{uuid.uuid4()}/a", False),
    (f"file:///elsewhere/{T}/a", False),
    (f"s3://bucket/{T}/a", False),
    (f"{BASE}/{T}/a?x=1", False),
    (f"file://otherhost/srv/objects/{T}/a", False),
])
def test_tenant_owns_only_its_prefix(ref: str, owned: bool) -> None:
    """Only references strictly below <store>/<tenant id>/ with clean segments are the tenant's."""
    assert tenant_owns(BASE, T, ref) is owned


def test_tenant_owns_on_s3_store() -> None:
    """With an s3:// store the bucket and prefix must match too."""
    assert tenant_owns("s3://b/calmq", T, f"s3://b/calmq/{T}/x")
    assert not tenant_owns("s3://b/calmq", T, f"s3://other/calmq/{T}/x")
    assert not tenant_owns("s3://b/calmq", T, f"s3://b/{T}/x")


def test_signature_verifies_and_rejects_tampering_and_staleness() -> None:
    """verify accepts a fresh signed body and rejects another body, secret or an old timestamp."""
    body = b'{"event":"completed"}'
    headers = {TIMESTAMP_HEADER: "1000", SIGNATURE_HEADER: sign("s", 1000, body)}
    assert verify("s", headers, body, now=1010)
    assert not verify("s", headers, body + b"x", now=1010)
    assert not verify("t", headers, body, now=1010)
    assert not verify("s", headers, body, now=2000)
    assert not verify("s", {SIGNATURE_HEADER: headers[SIGNATURE_HEADER]}, body, now=1010)


@pytest.mark.parametrize("url", ["http://127.0.0.1/x", "http://10.0.0.1/", "http://[::1]:8080/",
                                 "http://[::ffff:127.0.0.1]/", "http://169.254.169.254/",
                                 "http://100.64.0.1/", "http://224.0.0.1/"])
def test_non_public_callback_targets_are_refused(url: str) -> None:
    """IP-literal callback URLs outside the public internet are refused unless allowed."""
    with pytest.raises(ContractError) as refused:
        asyncio.run(check_callback_url(url, allow_private=False))
    assert refused.value.code == "callback_url_forbidden"
    asyncio.run(check_callback_url(url, allow_private=True))


@pytest.mark.parametrize("url", ["ftp://example.com/", "/relative", "http://", "http://h:99999/"])
def test_malformed_callback_urls_are_invalid(url: str) -> None:
    """Non-http(s), relative or hostless callback URLs are invalid_callback_url."""
    with pytest.raises(ContractError) as bad:
        asyncio.run(check_callback_url(url, allow_private=True))
    assert bad.value.code == "invalid_callback_url"


def test_public_ip_callback_is_allowed() -> None:
    """A public IP literal passes without any DNS lookup."""
    asyncio.run(check_callback_url("https://93.184.216.34/hook", allow_private=False))


def test_rotation_signs_the_standard_header_with_both_secrets() -> None:
    """With a previous secret, webhook-signature carries both signatures: the Standard
    Webhooks library verifies with either; Calmq-Signature is the newest secret's only."""
    from standardwebhooks.webhooks import Webhook, WebhookVerificationError

    from calmq.producers.webhooks import signed_headers, standard_secret

    body = b'{"event":"completed"}'
    ts = int(time.time())
    headers = signed_headers("new", "42", ts, body, previous="old")
    assert len(headers["webhook-signature"].split(" ")) == 2
    for secret in ("new", "old"):
        Webhook(standard_secret(secret)).verify(body, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(standard_secret("other")).verify(body, headers)
    assert verify("new", headers, body)
    assert not verify("old", headers, body)
    alone = signed_headers("new", "42", ts, body)
    assert len(alone["webhook-signature"].split(" ")) == 1
    with pytest.raises(WebhookVerificationError):
        Webhook(standard_secret("old")).verify(body, alone)
