# The README's two commands: `make demo` (the main job) and `make test` (the test suite).
# Each bootstraps what is missing first (scripts/bootstrap.sh; fast when already set up).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo proto bench-metaserver clean

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

clean:
	rm -rf $(VENV) .pytest_cache
