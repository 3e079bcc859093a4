# syntax=docker/dockerfile:1.7
#
# JAX LoRA trainer for AMD Instinct MI300X pools (ROCm).
#
#   docker build -f deploy/docker/trainer-jax-rocm.Dockerfile -t tunefleet/trainer-jax-rocm:0.1.0 .
#
# Base: AMD's ROCm 7 user-space image (HIP runtime, hipBLASLt, MIOpen, RCCL: what the
# JAX ROCm plugin loads from the local ROCm install). JAX itself is pinned like
# pyproject.toml (jax/jaxlib 0.10.2) with AMD's matching plugin wheels from PyPI
# (jax-rocm7-plugin / jax-rocm7-pjrt 0.10.2, cp311): the rocm/jax images pair other JAX
# and Python versions, and the project is tested on Python 3.11 with jax 0.10.2.
# The host needs the amdgpu driver; Kubernetes exposes the GPUs through the AMD GPU
# device plugin (amd.com/gpu).

ARG ROCM_IMAGE=rocm/dev-ubuntu-22.04:7.2.3-complete

FROM ${ROCM_IMAGE} AS build

# What JAX runs on: "rocm" (the default: AMD's plugin wheels, which load ROCm from the base
# image) or "cpu" (JAX's own CPU backend: the same image built on a plain Debian base with
# Python 3.11, to build and run where no GPU is, as in CI).
ARG ACCELERATOR=rocm
# pip's cache lives in a build cache mount (RUN --mount=type=cache), never in a layer.
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# Ubuntu 22.04 ships Python 3.11 in universe (the default python3 is 3.10). Not pinned to a
# Debian revision: the ROCm base tag is pinned, and security updates of 3.11 should apply.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
 && rm -rf /var/lib/apt/lists/*

RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

# AMD's documented order: PJRT plugin, JAX plugin, jaxlib, jax; all at one version.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-compile "pip==26.3" \
 && case "${ACCELERATOR}" in \
      rocm) pip install --no-compile "jax-rocm7-pjrt==0.10.2" "jax-rocm7-plugin==0.10.2" "jaxlib==0.10.2" "jax==0.10.2" ;; \
      cpu) pip install --no-compile "jaxlib==0.10.2" "jax==0.10.2" ;; \
      *) echo "ACCELERATOR must be rocm or cpu, not ${ACCELERATOR}" >&2; exit 1 ;; \
    esac

# Versions: held to the tested ones by the constraints files. The trackers extra: MLflow
# and W&B, which a job's `integrations` may mirror to. Each constraints file is its extra's
# whole dependency closure: installed before the code is copied, so a code change only
# reinstalls the project itself.
COPY deploy/docker/constraints/jax.txt /tmp/constraints.txt
COPY deploy/docker/constraints/trackers.txt /tmp/constraints-trackers.txt
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-compile -c /tmp/constraints.txt -c /tmp/constraints-trackers.txt \
      -r /tmp/constraints.txt -r /tmp/constraints-trackers.txt

COPY pyproject.toml README.md ./
COPY trainers ./trainers
COPY api/__init__.py ./api/__init__.py
COPY worker/__init__.py ./worker/__init__.py
COPY control/__init__.py ./control/__init__.py
COPY scheduling/__init__.py ./scheduling/__init__.py
COPY kube/__init__.py ./kube/__init__.py
COPY tunefleet/__init__.py ./tunefleet/__init__.py
COPY inference/__init__.py ./inference/__init__.py
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-compile -c /tmp/constraints.txt -c /tmp/constraints-trackers.txt ".[jax,trackers]" \
 && python -c "import jax; assert jax.__version__ == '0.10.2', jax.__version__" \
 && if [ "${ACCELERATOR}" = rocm ]; then python -c "import jax_rocm7_plugin"; fi \
 && python -c "import mlflow, wandb; print('mlflow', mlflow.__version__, 'wandb', wandb.__version__)"

FROM ${ROCM_IMAGE} AS runtime

LABEL org.opencontainers.image.title="tunefleet-trainer-jax-rocm" \
      org.opencontainers.image.description="tunefleet JAX LoRA trainer (ROCm, AMD Instinct MI300X)" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 \
 && rm -rf /var/lib/apt/lists/*

# The GPU device nodes (/dev/kfd, /dev/dri/renderD*) belong to the video and render groups.
RUN (getent group render >/dev/null || groupadd --system render) \
 && groupadd --system --gid 10001 tunefleet \
 && useradd --system --uid 10001 --gid 10001 --groups video,render --home-dir /home/tunefleet \
      --create-home --shell /usr/sbin/nologin tunefleet

COPY --from=build /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/tmp/hf \
    HF_HUB_OFFLINE=1 \
    XLA_PYTHON_CLIENT_PREALLOCATE=false

USER 10001:10001
WORKDIR /home/tunefleet

# The Kubernetes executor mounts the spec ConfigMap at /etc/tunefleet/spec (and passes the
# same arguments explicitly).
ENTRYPOINT ["python", "-m", "trainers"]
CMD ["--spec", "/etc/tunefleet/spec/spec.json"]
