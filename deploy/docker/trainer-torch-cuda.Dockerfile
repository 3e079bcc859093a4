# syntax=docker/dockerfile:1.7
#
# PyTorch FSDP + QLoRA trainer for consumer NVIDIA pools (RTX 3090/4090, 24 GB).
#
#   docker build -f deploy/docker/trainer-torch-cuda.Dockerfile -t tunefleet/trainer-torch-cuda:0.1.0 .
#
# Why not a pytorch/pytorch base image: the 2.13.0 images ship Python 3.12, while the
# project declares requires-python <3.12 and is tested on 3.11. torch==2.13.0 from PyPI
# IS the CUDA build (CUDA 13.0; cuDNN, NCCL and the CUDA runtime come as nvidia-* wheels),
# so a slim Python 3.11 base plus the pinned wheel gives the same torch the tests use, with
# CUDA. The host needs the NVIDIA driver (>= 580 for CUDA 13) and the NVIDIA container
# toolkit / device plugin; nothing CUDA is needed in the base image itself.
# For older drivers, build torch from PyTorch's CUDA 12.6 index:
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG TORCH_INDEX_URL=""
# What torch must be built for: "cuda" (the default: the build fails on a torch without
# CUDA) or "cpu" (a build whose package sources give torch's CPU wheel, as CI's do: the same
# image without GPU code, to build and run where no GPU is).
ARG ACCELERATOR=cuda
# pip's cache lives in a build cache mount (RUN --mount=type=cache), never in a layer.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

# torch first, alone, from its pinned requirement (requirements/torch.txt), so that no
# later resolution can pull a different build; then the torch extra (transformers, peft,
# bitsandbytes, hqq, ... pinned in pyproject.toml) with torch held by a constraint.
COPY requirements/torch.txt requirements/torch.txt
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-compile "pip==26.3" \
 && pip install --no-compile ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} -r requirements/torch.txt \
 && pip freeze | grep -i '^torch==' > /tmp/torch-constraint.txt \
 && python -c "import os, sys, torch; cuda = torch.version.cuda; want = os.environ['ACCELERATOR']; print('torch', torch.__version__, 'cuda', cuda); sys.exit(0 if want in ('cuda', 'cpu') and bool(cuda) == (want == 'cuda') else f'torch {torch.__version__} is not a {want} build')"

# Versions: held to the tested ones by the constraints files (torch: the build installed
# above). The trackers extra: MLflow and W&B, which a job's `integrations` may mirror to.
# Each constraints file is its extra's whole dependency closure: installed before the code
# is copied, so a code change only reinstalls the project itself.
COPY deploy/docker/constraints/torch.txt /tmp/constraints.txt
COPY deploy/docker/constraints/trackers.txt /tmp/constraints-trackers.txt
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    grep -v '^torch==' /tmp/constraints.txt > /tmp/constraints-no-torch.txt \
 && pip install --no-compile -c /tmp/constraints-no-torch.txt -c /tmp/torch-constraint.txt \
      -c /tmp/constraints-trackers.txt -r /tmp/constraints-no-torch.txt -r /tmp/constraints-trackers.txt

COPY pyproject.toml README.md ./
COPY trainers ./trainers
# setuptools packages every top-level package it finds; the trainer image only needs
# `trainers` at run time, the others are empty shells here.
COPY api/__init__.py ./api/__init__.py
COPY worker/__init__.py ./worker/__init__.py
COPY control/__init__.py ./control/__init__.py
COPY scheduling/__init__.py ./scheduling/__init__.py
COPY kube/__init__.py ./kube/__init__.py
COPY tunefleet/__init__.py ./tunefleet/__init__.py
COPY inference/__init__.py ./inference/__init__.py
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-compile -c /tmp/constraints-no-torch.txt -c /tmp/torch-constraint.txt \
      -c /tmp/constraints-trackers.txt ".[torch,trackers]" \
 && python -c "import torch, bitsandbytes, hqq, peft, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
 && python -c "import mlflow, wandb; print('mlflow', mlflow.__version__, 'wandb', wandb.__version__)"

FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="tunefleet-trainer-torch-cuda" \
      org.opencontainers.image.description="tunefleet PyTorch FSDP+QLoRA trainer (CUDA)" \
      org.opencontainers.image.licenses="Apache-2.0"

RUN groupadd --system --gid 10001 tunefleet \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/tunefleet --create-home \
      --shell /usr/sbin/nologin tunefleet

COPY --from=build /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/tmp/hf \
    HF_HUB_OFFLINE=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

USER 10001:10001
WORKDIR /home/tunefleet

# The Kubernetes executor mounts the spec ConfigMap at /etc/tunefleet/spec (and passes the
# same arguments explicitly).
ENTRYPOINT ["python", "-m", "trainers"]
CMD ["--spec", "/etc/tunefleet/spec/spec.json"]
