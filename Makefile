# The public interface: test, test-fast, test-container, demo, serve, stop, mar, bench,
# notebook, endpoint, soak, image, capacity (names and meaning stay stable).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_MODEL_DIR := models/demo-llava
# make mar MAR_WEIGHTS=reference MODEL_DIR=/abs/llava-1.5-7b-hf: the .mar points at the weights.
# Both stick: later `make mar` / `make serve` archive the same model until told otherwise
# (model-store/llava.source.json). Unset and never given: the demo model, weights inside.
MODEL_DIR ?=
MAR_WEIGHTS ?=
MAR_CHOICE = $(if $(MODEL_DIR),--model-dir $(MODEL_DIR)) $(if $(MAR_WEIGHTS),--weights $(MAR_WEIGHTS))
# e.g. SERVE_FLAGS="--instance-dir .run/b --inference-port 8090 --management-port 8091 ..."
SERVE_FLAGS ?=
# make endpoint: the local SageMaker-compatible endpoint over N TorchServe instances, each
# running torch on ENDPOINT_THREADS threads (auto: the cores split evenly between them).
ENDPOINT_INSTANCES ?= 2
ENDPOINT_THREADS ?= auto
ENDPOINT_PORT ?= 8090
ENDPOINT_DIR ?= .run/endpoint
# A durable store every instance shares (sessions outlive their instance): s3-local (moto's S3
# on 127.0.0.1, stopped by `make stop`), a directory, or s3://bucket/prefix; empty: none.
ENDPOINT_DURABLE_STORE ?=

.PHONY: setup test test-fast test-container lint demo bench gpu-check build-demo-model mar demo-mar \
	serve stop endpoint soak notebook image capacity clean

# CUDA machines: `make setup TORCH_INDEX=<PyTorch wheel index for your CUDA version>` on a
# fresh checkout (or after `rm -rf .venv`) installs that build of torch 2.13.0 instead.
TORCH_INDEX ?=

# torch==2.13.0 goes in first: it is the local CPU wheel (or TORCH_INDEX's build); anything
# that depends on torch installed before it would pull a multi-GB CUDA build.
$(VENV)/.installed: setup.cfg pyproject.toml
	command -v jcmd >/dev/null || (apt-get update && apt-get install -y openjdk-17-jdk-headless)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[engine,serve,deploy,dev,notebook]'
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/shellcheck docker/entrypoint.sh scripts/build_and_push.sh scripts/gpu/carry.sh

# Every tier: tests/unit, tests/serving (real TorchServe, serving the demo model's .mar,
# model-store/llava.mar), tests/container (the image's build side; the image itself runs under
# test-container) and tests/install (fresh venvs from the package index).
test: setup lint demo-mar
	$(PY) -m pytest -q

# The developer's loop: the unit tier alone (no TorchServe, no Java, no Docker, no index),
# without its thorough checks (marker `thorough`: `make test` runs them), on every core; its
# bytecode and rewritten asserts are kept between runs even where the environment says not to.
test-fast: setup
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n auto -m "not thorough" tests/unit

# The container tier (.ci/run runs it after `test`): starts a Docker engine if none answers
# (installing Debian's docker.io if missing), makes the stand-in base image once, builds the
# CPU flavour and runs it as SageMaker does (scripts/container_tier.py). One line and no
# failure if Docker cannot start on this machine.
test-container: setup demo-mar
	$(PY) -m scripts.container_tier

# The production image (CUDA torch; Docker Hub's python base): `docker build` of the Dockerfile.
# IMAGE_BUILD_FLAGS e.g. "--network host" where the build needs the host's network, or
# "--build-arg TORCH_INDEX=<PyTorch wheel index>" for another CUDA version.
IMAGE_NAME ?= stateful-llava
IMAGE_BUILD_FLAGS ?=
image:
	docker build $(IMAGE_BUILD_FLAGS) -t $(IMAGE_NAME) .

# Archives, serves on loopback, chats about a demo image, closes, stops (see scripts/demo.py).
demo: demo-mar
	$(PY) -m scripts.demo

# Per-turn latency by cache mode (realistic-shape models), TorchServe's overhead per turn,
# the handler's per-request cost against the number of idle sessions held, the local
# endpoint's hop, what the container's /ping front adds per turn, many sessions at once
# (batched turns against one request at a time), then session memory across tiers (restore
# from host against recompute, sessions per tier, accounted against actual bytes), and the
# persistent tier (turn latency on/off, bytes per session, kill to the next answered turn),
# then shared prefixes (an open on a held image against a cold one, bytes of 32 sessions on
# one image against 32 images, turn time with sharing on and off), a second image in a
# session's turn against a new session for it and against stateless, and the next answer of
# a session whose instance went: resumed from the durable store against replay and a fresh open,
# and turn 10's first token for an OpenAI client resending its conversation, with and without a
# session.
bench: demo-mar
	$(PY) -m scripts.bench.turns
	$(PY) -m scripts.bench.turns --config realistic-next
	$(PY) -m scripts.bench.handler
	$(PY) -m scripts.bench.sessions
	$(PY) -m scripts.bench.endpoint
	$(PY) -m scripts.bench.front
	$(PY) -m scripts.bench.runner --threads 1
	$(PY) -m scripts.bench.attention
	$(PY) -m scripts.bench.concurrency
	$(PY) -m scripts.bench.memory
	$(PY) -m scripts.bench.persist
	$(PY) -m scripts.bench.prefix
	$(PY) -m scripts.bench.images
	$(PY) -m scripts.bench.resume
	$(PY) -m scripts.bench.openai_resend

# On a CUDA machine: preflight, the attention candidates, the engine's table on a
# random-weight model of llava-1.5-7b's shape, the CUDA tests and two shards, each step
# isolated, its JSON line in .run/gpu-check/results.jsonl (scripts/gpu/check.py). Without
# CUDA: one line, exit 0. A lent GPU machine runs it without make setup:
# python3 -u -m scripts.gpu_check --out $OUT (docs/testing.md §GPU check).
gpu-check: setup
	$(PY) -m scripts.gpu_check --out .run/gpu-check

# Rebuilds and retrains the committed demo model (deterministic, ~minutes on 2 cores).
build-demo-model: setup
	$(PY) -m demo_model.build --out $(or $(MODEL_DIR),$(DEMO_MODEL_DIR))

# Always rebuilt (seconds for the demo model or a reference): a stale .mar is worse than a
# rebuild. Refuses at once, in one line, a missing or empty MODEL_DIR or a checkpoint the
# engine does not serve (docs/models.md §Refused, and why).
mar: setup
	$(PY) -m serving.mar --remember $(MAR_CHOICE)

# The demo model's .mar for demo, test and bench; the model `make mar` remembers stays as it is.
demo-mar: setup
	$(PY) -m serving.mar --model-dir $(DEMO_MODEL_DIR) --weights inside

# Serves the model `make mar` was last given (rebuilt, so the code is fresh). Returns once the
# worker is READY, or fails with the tail of TorchServe's logs (.run/); a bad setting fails at
# once with its one line.
serve: mar
	$(PY) -m serving.torchserve start $(SERVE_FLAGS)

# Stops what `serve` and what `endpoint` started.
stop: setup
	$(PY) -m serving.torchserve stop $(SERVE_FLAGS)
	$(PY) -m local_endpoint.launcher stop --run-dir $(ENDPOINT_DIR)

# Returns once every instance has a READY worker and the endpoint answers on ENDPOINT_PORT.
endpoint: mar
	$(PY) -m local_endpoint.launcher start --instances $(ENDPOINT_INSTANCES) \
		--threads=$(ENDPOINT_THREADS) --port $(ENDPOINT_PORT) --run-dir $(ENDPOINT_DIR) \
		$(if $(ENDPOINT_DURABLE_STORE),--durable-store $(ENDPOINT_DURABLE_STORE))

# Load, faults and bad input together for SOAK_SECONDS with SOAK_SESSIONS conversations, against
# `make endpoint`'s setup started on free ports (2 instances) through boto3 (scripts/soak/):
# one table, non-zero if a rule breaks. The defaults suit a 2-core machine.
SOAK_SECONDS ?= 90
SOAK_SESSIONS ?= 8
soak: demo-mar
	SOAK_SECONDS=$(SOAK_SECONDS) SOAK_SESSIONS=$(SOAK_SESSIONS) $(PY) -m scripts.soak

# Executes the deploy-and-infer notebook in local mode into build/notebooks/ (it runs
# `make endpoint` and `make stop` itself, on ENDPOINT_PORT).
notebook: setup
	$(PY) -m scripts.run_notebook --port $(ENDPOINT_PORT) --run-dir $(ENDPOINT_DIR)

# Sessions per instance at each memory tier, by arithmetic from the engine's own accounting
# (python -m capacity --help). Reads the config and tokenizer only: no weights needed.
CAPACITY_MODEL_DIR ?= $(or $(MODEL_DIR),tests/fixtures/llava-1.5-7b-hf)
CAPACITY_FLAGS ?=
capacity: setup
	$(PY) -m capacity --model-dir $(CAPACITY_MODEL_DIR) $(CAPACITY_FLAGS)

clean:
	rm -rf build .pytest_cache .ruff_cache
