# The calmq image: every component (api, relay, worker, forwarder, reaper, fake provider)
# is `calmq <command>` in it. docker-compose.kafka.yml builds and runs it.
FROM python:3.12-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY calmq calmq
COPY producers producers
COPY relay relay
COPY processors processors
COPY schemas schemas
# Editable: calmq finds schemas/ next to its package (calmq.codec.default_schemas_dir).
RUN pip install -e . \
    && useradd --uid 10001 --no-create-home calmq
USER calmq

EXPOSE 8080 9100
CMD ["calmq", "api"]
