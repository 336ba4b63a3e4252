# SageMaker bring-your-own-container image: TorchServe 0.12 with the stateful-llava handler and a
# CUDA build of torch. SageMaker runs `docker run <image> serve`: docker/serve.py starts
# TorchServe on internal ports behind a front on 8080 whose /ping is 200 only once a worker is
# READY, serving the model SageMaker puts under /opt/ml/model (README "Deploying to SageMaker").
#
#   docker build -t stateful-llava .            (scripts/build_and_push.sh also pushes to ECR)
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 -t stateful-llava .
FROM python:3.11-slim-bookworm

# torch's CUDA wheels carry the CUDA runtime libraries (as nvidia-* wheels), so the base image
# needs no CUDA toolkit; the host supplies only the driver. Pick the index of a CUDA version
# that the instance type's driver supports.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

# NVIDIA_*: the nvidia container runtime mounts the host's driver only when these ask for it.
# No PYTHONPATH: TorchServe puts it ahead of the extracted .mar in the worker's path, and the
# worker must import llava/ and handlers/ from the .mar it serves (docker/serve.py finds this
# directory's packages by itself).
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Java 17 for TorchServe's frontend; tini as PID 1, so that `docker stop`'s SIGTERM reaches the
# entrypoint and exited workers are reaped. Debian's versions are not pinned: a security update
# removes the old version from the archive, and a pinned build would then fail.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless tini \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/stateful-llava

# torch first and from the CUDA index: anything installed before it that depends on torch would
# pull PyPI's default build. The check fails the build if a CPU-only torch got in anyway.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}" \
    && python -c "import sys, torch; sys.exit(torch.version.cuda is None)"

# The project with its serving extra (TorchServe, archiver, PyYAML, psutil), then the code the
# entrypoint runs from this directory (it archives llava/ and handlers/ for a bare checkpoint).
# The versions are setup.cfg's pins (torchserve==0.12.0, transformers==5.23.0, ...).
COPY setup.cfg pyproject.toml README.md ./
COPY llava llava
COPY handlers handlers
# hadolint ignore=DL3013
RUN pip install ".[engine,serve]" \
    && python -c "import sys, torch; sys.exit(torch.version.cuda is None)"
COPY config.properties model-config.yaml ./
COPY scripts scripts
COPY docker docker

EXPOSE 8080
ENTRYPOINT ["/usr/bin/tini", "--", "/opt/stateful-llava/docker/entrypoint.sh"]
CMD ["serve"]
