"""The wires' registry (calmq.calls.wires.WIRES): the settings offer exactly its providers,
each opens its own wire and batch client, and the facts it declares are the ones the
pricing, the stack and the settings act on."""

from __future__ import annotations

from typing import get_args

import pytest

from calmq.calls.pricing import price_source
from calmq.calls.wires import WIRES, open_batch_client, open_provider, wire
from calmq.errors import ConfigError
from calmq.settings import Settings


def test_the_settings_offer_exactly_the_registered_providers() -> None:
    """CALMQ_PROVIDER and CALMQ_EMBEDDINGS_PROVIDER take the registry's names, no others."""
    fields = Settings.model_fields
    assert set(get_args(fields["provider"].annotation)) == set(WIRES)
    assert set(get_args(fields["embeddings_provider"].annotation)) == {"", *WIRES}


@pytest.mark.parametrize("kind", sorted(WIRES))
def test_each_provider_opens_its_own_wire_and_batch_client(kind: str) -> None:
    """open_provider and open_batch_client dispatch through the registry: the wire's
    classes, at the wire's endpoint."""
    found = WIRES[kind]
    assert found.kind == kind
    provider = open_provider(kind, "http://unused", "k", "m")
    assert type(provider) is found.provider
    assert type(provider.endpoint_config) is found.endpoint
    if found.batches is not None:
        client = open_batch_client(kind, "http://unused", "k", "m")
        assert type(client) is found.batches
        assert type(client.api) is found.endpoint
        assert client.batches_path.startswith("/")


@pytest.mark.parametrize("kind", sorted(WIRES))
def test_the_settings_embeddings_follow_the_wire(kind: str) -> None:
    """A provider without an embeddings API has no embeddings endpoint unless another
    provider is set for it (calmq.settings.Settings.embeddings_endpoint agrees with the
    wire's ``embeddings``)."""
    settings = Settings.load(environ={"CALMQ_PROVIDER": kind})
    assert (settings.embeddings_endpoint is not None) == wire(kind).embeddings


def test_the_price_table_name_comes_from_the_wire() -> None:
    """Azure OpenAI is priced at OpenAI's table prices (its wire says so); an unknown kind
    has no table."""
    assert WIRES["azure"].price_table == WIRES["openai"].price_table == "openai"
    assert price_source({}, "azure", "gpt-4o-mini") == "genai-prices"
    assert price_source({}, "anthropic", "claude-sonnet-4-5") == "genai-prices"
    assert price_source({}, "nowhere", "gpt-4o-mini") == "none"


def test_an_unknown_provider_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        open_provider("nowhere", "http://unused", "k", "m")
