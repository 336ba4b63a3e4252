# SageMaker bring-your-own-container image: TorchServe 0.12 with the stateful-llava handler and a
# CUDA build of torch. SageMaker runs `docker run <image> serve`: docker/serve.py (the start is
# serving/container.py) starts TorchServe on internal ports behind a front on 8080 whose /ping
# is 200 only once a worker is READY, serving the model SageMaker puts under /opt/ml/model
# (docs/deploy.md §Deploying, step by step).
#
#   make image                                  (docker build -t stateful-llava .)
#   scripts/build_and_push.sh                   (builds and pushes to ECR)
#   make test-container                         (the CPU flavour on a local base: the tests)
#
# The production build is the defaults: Docker Hub's python base and PyPI's torch, whose CUDA
# 13.0 build runs on the SageMaker inference AMI `python -m deploy create` asks for
# (docs/container.md §The image: driver and CUDA).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# NVIDIA_*: the nvidia container runtime mounts the host's driver only when these ask for it.
# No PYTHONPATH: TorchServe puts it ahead of the extracted .mar in the worker's path, and the
# worker must import llava/ and handlers/ from the .mar it serves (docker/serve.py imports the
# installed packages, and passes this directory for config.properties and model-config.yaml).
# A venv: a Debian base's own python3 refuses system-wide pip.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# Java 17 for TorchServe's frontend; tini as PID 1, so that `docker stop`'s SIGTERM reaches the
# entrypoint and exited workers are reaped. Debian's versions are not pinned: a security update
# removes the old version from the archive, and a pinned build would then fail.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless tini \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /opt/stateful-llava

# TORCH_FLAVOUR: cuda (production; the build fails if torch came without CUDA) or cpu (the test
# tier's image, built in minutes). TORCH_INDEX: empty = PyPI's default build, else the index
# of another CUDA version. PIP_* build arguments reach pip as its environment (the test tier
# points them at this machine's local wheels and indexes); none is left in the image. All are
# declared after the apt layer, which a change of their values would otherwise rebuild.
ARG TORCH_VERSION=2.13.0
ARG TORCH_FLAVOUR=cuda
ARG TORCH_INDEX=
ARG PIP_FIND_LINKS
ARG PIP_EXTRA_INDEX_URL
ARG PIP_CERT

# torch first: anything installed before it that depends on torch would pull PyPI's default
# build. docker/check_torch.py fails the build if torch is not of TORCH_FLAVOUR. (hadolint cannot
# see the pin through the optional --index-url.)
COPY docker/check_torch.py docker/
# hadolint ignore=DL3013
RUN pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX:+--index-url "${TORCH_INDEX}"} \
    && python docker/check_torch.py "${TORCH_FLAVOUR}"

# The project with its serving extra (TorchServe, archiver, PyYAML, psutil), then the code the
# entrypoint runs from this directory (it archives llava/ and handlers/ for a bare checkpoint).
# The versions are setup.cfg's pins (torchserve==0.12.0, transformers==5.23.0, ...).
COPY setup.cfg pyproject.toml README.md ./
COPY llava llava
COPY handlers handlers
COPY llava_wire llava_wire
COPY serving serving
# hadolint ignore=DL3013
RUN pip install ".[engine,serve]" \
    && python docker/check_torch.py "${TORCH_FLAVOUR}"
COPY config.properties model-config.yaml ./
COPY scripts scripts
COPY docker docker

# Not root: a fixed uid (a host or a policy can name it), no password, no login shell; -l keeps
# a high uid from growing /var/log/lastlog into a huge sparse file. The code and the venv stay
# root's, read-only to it. It writes only to /tmp (TorchServe's SERVE_WORK_DIR, the persistent
# tier's fallback) and /dev/shm (the persistent tier), both writable by any user, and its home
# (compiler caches); /opt/ml/model, which SageMaker mounts read-only and owned by root, it only
# reads (docs/container.md §The image).
RUN useradd --uid 10001 --user-group --no-log-init --create-home --home-dir /home/llava \
        --shell /usr/sbin/nologin llava
USER 10001:10001

EXPOSE 8080
ENTRYPOINT ["/usr/bin/tini", "--", "/opt/stateful-llava/docker/entrypoint.sh"]
CMD ["serve"]
