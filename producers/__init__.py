"""The intake side: the HTTP API (``calmq.producers.api.build_app``) and the client library
that upstream services embed (``calmq.producers.client``).

Nothing is imported here: ``import calmq.producers.client`` must not load the server.
"""
