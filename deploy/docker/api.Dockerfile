# syntax=docker/dockerfile:1.7
#
# tunefleet control plane: ONE image for the API, the Celery worker, the scheduler and the
# migrations Job (the role is the command). Only the `server` extra: no torch, no jax.
#
#   docker build -f deploy/docker/api.Dockerfile -t tunefleet/api:0.1.0 .
#
# Roles:   uvicorn --factory api.main:create_app ...   (default CMD)
#          tunefleet worker | tunefleet scheduler | tunefleet db upgrade
#
# EXTRAS=server is the production control plane (trainers run in their own images as
# Kubernetes Jobs). docker-compose.yml builds the worker with EXTRAS=server,torch,jax so
# the local executor can run trainers as subprocesses of the worker container.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---- build: a virtualenv with the project and its server dependencies ---------------------
FROM ${PYTHON_IMAGE} AS build

ARG EXTRAS=server

# pip's cache lives in a build cache mount (RUN --mount=type=cache), never in a layer.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
# Versions: every package is held to the tested version by the constraints files; torch
# (only with the torch extra) is installed first and alone, as in the Makefile. The
# dependencies are installed before the code is copied (each extra's constraints file is
# its whole dependency closure), so a code change only reinstalls the project itself.
COPY requirements/torch.txt requirements/torch.txt
COPY deploy/docker/constraints/ /tmp/constraints/
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    cat /tmp/constraints/*.txt > /tmp/constraints.txt \
 && for extra in $(IFS=,; echo ${EXTRAS}); do cat "/tmp/constraints/${extra}.txt"; done > /tmp/closure.txt \
 && pip install --no-compile "pip==26.3" \
 && case ",${EXTRAS}," in *,torch,*) pip install --no-compile -c /tmp/constraints.txt -r requirements/torch.txt ;; esac \
 && pip install --no-compile -c /tmp/constraints.txt -r /tmp/closure.txt

COPY pyproject.toml README.md ./
COPY api ./api
COPY worker ./worker
COPY control ./control
COPY scheduling ./scheduling
COPY kube ./kube
COPY trainers ./trainers
COPY tunefleet ./tunefleet
COPY inference ./inference
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-compile -c /tmp/constraints.txt ".[${EXTRAS}]" \
 && if [ "${EXTRAS}" = "server" ]; then python -c "import importlib.util as u, sys; bad=[m for m in ('torch','jax') if u.find_spec(m)]; sys.exit(f'server image must not contain {bad}' if bad else 0)"; fi

# ---- runtime ---------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="tunefleet-api" \
      org.opencontainers.image.description="tunefleet control plane: API, Celery worker, scheduler, migrations" \
      org.opencontainers.image.licenses="Apache-2.0"

# A fixed numeric uid/gid so Kubernetes' runAsNonRoot can verify it without /etc/passwd.
RUN groupadd --system --gid 10001 tunefleet \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/tunefleet --create-home \
      --shell /usr/sbin/nologin tunefleet

COPY --from=build /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TUNEFLEET_DATA_DIR=/var/lib/tunefleet

RUN mkdir -p /var/lib/tunefleet && chown 10001:10001 /var/lib/tunefleet
VOLUME ["/var/lib/tunefleet"]

USER 10001:10001
WORKDIR /home/tunefleet
EXPOSE 8000

# The API's liveness endpoint; the worker and scheduler roles override or disable it
# (docker-compose.yml), Kubernetes uses its own probes.
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status == 200 else 1)"]

CMD ["uvicorn", "--factory", "api.main:create_app", "--host=0.0.0.0", "--port=8000", "--proxy-headers"]
