# The calmq image: every component (api, relay, worker, forwarder, reaper, batcher, fake
# provider) is `calmq <command>` in it. docker-compose.kafka.yml builds and runs it; the
# release workflow (.github/workflows/release.yml) pushes it (docs/how-to/deploy-kubernetes.md,
# "What a release contains").
#
# Pinned: the base image to a patch release of the Python the lock was made with, and the
# wheel's dependencies to requirements.lock (`make lock`), installed as they are (--no-deps)
# and checked (pip check), each wheel's sha256 checked (--require-hashes). The lock also holds the otel and msk-iam extras' dependencies,
# so the image traces (OpenTelemetry) and speaks MSK IAM without a build of one's own.
# The wheel is built in a stage of its own and installed as users
# install it: no checkout, no editable install, the schemas and SQL as package data.
# tests/integration/test_image.py runs these steps without a Docker engine.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY calmq calmq
COPY producers producers
COPY relay relay
COPY processors processors
COPY schemas schemas
# calmq requires calmq-client, built here from its own folder (it is on no index).
COPY clients/python clients/python
RUN pip wheel --no-deps --wheel-dir /wheels . ./clients/python

FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY requirements.lock /tmp/requirements.lock
COPY --from=build /wheels /wheels
RUN pip install --no-deps --require-hashes -r /tmp/requirements.lock \
    && pip install /wheels/*.whl --no-deps \
    && pip check \
    && rm -rf /wheels /tmp/requirements.lock \
    && useradd --uid 10001 --no-create-home calmq
USER 10001

EXPOSE 8080 9100
CMD ["calmq", "api"]
