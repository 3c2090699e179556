# The calmq image: every component (api, relay, worker, forwarder, reaper, fake provider)
# is `calmq <command>` in it. docker-compose.kafka.yml builds and runs it.
# The wheel is built in a stage of its own and installed as users install it: no checkout,
# no editable install, the schemas and SQL as package data.
FROM python:3.12-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY calmq calmq
COPY producers producers
COPY relay relay
COPY processors processors
COPY schemas schemas
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.12-slim
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /wheels /wheels
RUN pip install /wheels/*.whl && rm -rf /wheels \
    && useradd --uid 10001 --no-create-home calmq
USER calmq

EXPOSE 8080 9100
CMD ["calmq", "api"]
