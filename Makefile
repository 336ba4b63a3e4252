# The public interface: test, demo, serve, stop, mar, bench (names and meaning stay stable).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL_DIR ?= models/demo-llava
# make mar MAR_WEIGHTS=reference MODEL_DIR=/abs/llava-1.5-7b-hf: the .mar points at the weights.
MAR_WEIGHTS ?= inside
# e.g. SERVE_FLAGS="--instance-dir .run/b --inference-port 8090 --management-port 8091 ..."
SERVE_FLAGS ?=

.PHONY: setup test lint demo bench build-demo-model mar serve stop clean

# torch==2.13.0 goes in first: it is the local CPU wheel; anything that depends on torch
# installed before it would pull a multi-GB CUDA build.
$(VENV)/.installed: setup.cfg pyproject.toml
	command -v java >/dev/null || (apt-get update && apt-get install -y openjdk-17-jre-headless)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[serve,deploy,dev,notebook]'
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/shellcheck docker/entrypoint.sh scripts/build_and_push.sh

# `mar` first: the TorchServe tests serve the very .mar that `make mar` builds.
test: setup lint mar
	$(PY) -m pytest -q

# Archives, serves on loopback, chats about a demo image, closes, stops (see scripts/demo.py).
demo: mar
	$(PY) scripts/demo.py

# Per-turn latency by cache mode (realistic-shape model), then TorchServe's overhead per turn,
# then what the container's /ping front adds per turn.
bench: mar
	$(PY) scripts/bench_turns.py
	$(PY) scripts/bench_handler.py
	$(PY) scripts/bench_front.py

# Rebuilds and retrains the committed demo model (deterministic, ~minutes on 2 cores).
build-demo-model: setup
	$(PY) scripts/build_demo_model.py --out $(MODEL_DIR)

# Always rebuilt (seconds for the demo model): a stale .mar is worse than a rebuild.
mar: setup
	$(PY) scripts/make_mar.py --model-dir $(MODEL_DIR) --weights $(MAR_WEIGHTS)

# Returns once the worker is READY, or fails with the tail of TorchServe's logs (.run/).
serve: mar
	$(PY) scripts/torchserve_ctl.py start $(SERVE_FLAGS)

stop: setup
	$(PY) scripts/torchserve_ctl.py stop $(SERVE_FLAGS)

clean:
	rm -rf build .pytest_cache .ruff_cache
