"""The console's pure parts: roles, escaping in templates, the review form's corrections,
storable form text, sign-in redirects, CSRF tokens and the SVG charts (the pages themselves:
tests/e2e/test_console.py)."""

from __future__ import annotations

import uuid

import pytest
from multidict import MultiDict

from calmq.data.console import search_terms
from calmq.data.tenants import ROLES, Tenant, parse_roles
from calmq.errors import ContractError
from calmq.producers.console.charts import bars
from calmq.producers.console.forms import checked, storable_problem
from calmq.producers.console.session import csrf_token, safe_next
from calmq.producers.console.shaping import corrections, output_fields
from calmq.producers.console.templates import Markup, environment
from calmq.workflows.invoice import InvoiceFields


def test_a_key_without_roles_keeps_every_role() -> None:
    tenant = Tenant(uuid.uuid4(), "acme", "cq_123456789")
    assert tenant.roles == ROLES == ("submit", "review", "operate")
    assert all(tenant.can(r) for r in ROLES)
    assert parse_roles(None) is None
    assert parse_roles("all") is None


def test_roles_parse_from_a_comma_list_and_unknown_ones_are_refused() -> None:
    assert parse_roles("review, operate,review") == ("review", "operate")
    with pytest.raises(ContractError) as err:
        parse_roles("review,admin")
    assert err.value.code == "invalid_roles"
    assert "admin" in err.value.message
    reviewer = Tenant(uuid.uuid4(), "acme", "cq_x", ("review",))
    assert reviewer.can("review")
    assert not reviewer.can("operate")


def _render(source: str, **context: object) -> str:
    return environment().from_string(source).render(**context)


def test_every_value_is_escaped_in_text_and_attributes_but_markup() -> None:
    """Templates escape what they print, in text and in attributes; Markup passes as is."""
    hostile = '<script>"x"</script>'
    assert _render("{{ v }}", v=hostile) == "&lt;script&gt;&#34;x&#34;&lt;/script&gt;"
    assert _render('<a title="{{ v }}">', v='" onmouseover="x') == (
        '<a title="&#34; onmouseover=&#34;x">')
    assert _render("{{ v|text }}", v={"a": "<b>"}) == "{&#34;a&#34;: &#34;&lt;b&gt;&#34;}"
    assert _render("{{ v }}", v=Markup("<b>ok</b>")) == "<b>ok</b>"
    html = _render('{% from "macros.html" import table %}{{ table("t", ["h"], rows) }}',
                   rows=[["<img src=x>"]])
    assert "<img" not in html
    assert "<td>&lt;img src=x&gt;</td>" in html


def test_the_review_form_follows_the_output_model_and_keeps_only_changes() -> None:
    output = {"vendor": "Blurry", "invoice_number": "7?1", "total": 88.0, "currency": "EUR"}
    fields = output_fields(InvoiceFields, output)
    assert [(n, k, r) for n, k, _v, r in fields] == [
        ("vendor", "string", True), ("invoice_number", "string", True),
        ("total", "number", True), ("currency", "string", True)]
    form = MultiDict({"field:vendor": "Blurry", "field:invoice_number": "791",
                      "field:total": "88.5", "field:currency": "EUR"})
    assert corrections(fields, form) == {"invoice_number": "791", "total": 88.5}
    with pytest.raises(ContractError) as err:
        corrections(fields, MultiDict({"field:total": "lots"}))
    assert (err.value.code, err.value.status) == ("invalid_fields", 422)


def test_text_postgresql_cannot_store_is_refused_with_the_field_named() -> None:
    """A NUL character (or a lone surrogate) in a field, or inside a corrected JSON value,
    is a 422 invalid_form naming the field, never a database error."""
    assert storable_problem("fine \u00e9") is None
    assert "NUL" in (storable_problem("a\x00b") or "")
    assert "surrogate" in (storable_problem("a\ud800b") or "")
    assert storable_problem({"k": ["ok", {"deep": "x\x00"}]}) is not None
    with pytest.raises(ContractError) as err:
        checked("the reason", "bad\x00reason")
    assert (err.value.code, err.value.status) == ("invalid_form", 422)
    assert "the reason" in err.value.message
    fields = output_fields(None, {"notes": None, "vendor": "x"})
    with pytest.raises(ContractError) as err:
        corrections(fields, MultiDict({"field:notes": '{"a": "\\u0000"}'}))
    assert (err.value.code, "notes") == ("invalid_form", err.value.message.split()[0])


def test_sign_in_only_returns_to_console_pages() -> None:
    assert safe_next("/console/jobs?status=queued") == "/console/jobs?status=queued"
    for bad in (None, "", "https://evil.example/", "//evil.example/console/", "/v1/jobs"):
        assert safe_next(bad) == "/console/overview"


def test_csrf_tokens_differ_per_session_and_do_not_reveal_it() -> None:
    a, b = csrf_token("cqs_aaaa"), csrf_token("cqs_bbbb")
    assert a != b
    assert a == csrf_token("cqs_aaaa")
    assert "cqs_aaaa" not in a


def test_a_chart_is_an_accessible_svg_with_its_numbers() -> None:
    svg = bars("Tokens per hour", ["10:00", "11:00"], [("tokens", [5.0, 10.0])],
               limit=20.0, limit_label="budget")
    assert 'role="img"' in svg
    assert "<title>Tokens per hour</title>" in svg
    assert "tokens: 5, 10" in svg
    assert 'class="limit"' in svg


def test_search_terms_cover_an_id_prefix_and_a_metadata_value() -> None:
    """A hexadecimal prefix (dashes ignored) becomes the id range it covers; any search
    becomes a JSON path equal to it as text, and as a number when it reads as one."""
    terms = search_terms("5CA1E-0")
    assert (terms["id_low"], terms["id_high"]) == ("5ca1e000-0000-0000-0000-000000000000",
                                                   "5ca1e0ff-ffff-ffff-ffff-ffffffffffff")
    assert terms["metadata_path"] == '$.* ? (@ == "5CA1E-0")'
    word = search_terms('order "7"')
    assert (word["id_low"], word["id_high"]) == (None, None)
    assert word["metadata_path"] == '$.* ? (@ == "order \\"7\\"")'
    assert search_terms("12")["metadata_path"] == '$.* ? (@ == "12" || @ == 12)'
    assert search_terms("inf")["metadata_path"] == '$.* ? (@ == "inf")'
    assert search_terms(None) == {"id_low": None, "id_high": None, "metadata_path": None}
