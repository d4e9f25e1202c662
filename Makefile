# Set-up is automatic: every target creates .venv/ at the repo root when it
# is missing and installs the project (with test and bench extras) into it.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export JAX_PLATFORMS ?= cpu
# libtpu's start-up chatter goes to stderr; keep the user's terminal clean.
export TF_CPP_MIN_LOG_LEVEL ?= 3
export ALLOW_MULTIPLE_LIBTPU_LOAD ?= 1

.PHONY: help demo test fuzz doctest docs lint bench clean

# `make` alone lists the targets (it used to create .venv/ and stop).
.DEFAULT_GOAL := help
help:
	@echo "make demo     installs, then runs examples/demo.py (no TPU needed)"
	@echo "make test     the test suite (TEST_WORKERS=0: one process)"
	@echo "make fuzz     generated loop programs (FUZZ_EXAMPLES=200 for more)"
	@echo "make doctest  the docstring examples of the package"
	@echo "make docs     API reference from the docstrings, into docs/api/"
	@echo "make lint     ruff check and format --check"
	@echo "make bench    python -m benchmarks.run: modelled TPU step times"
	@echo "              (BENCH_ARGS='--help' for its flags)"
	@echo "make clean    removes .venv/"

$(PY):
	python3 -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[tpu,test,bench,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# The suite runs a worker per core (pytest-xdist); TEST_WORKERS=0 runs it
# in one process.
TEST_WORKERS ?= auto
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal tests

# Many generated loop programs (tests/test_loop_fuzz.py), each compiled for
# a TPU topology and run on CPU; prints how many programs, copies and
# refusals it saw. FUZZ_EXAMPLES=200 make fuzz for a longer run.
FUZZ_EXAMPLES ?= 60
fuzz: $(STAMP)
	ASYNCOPS_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest tests/test_loop_fuzz.py -q -s

# Docstring examples of the package (run in CI too).
doctest: $(STAMP)
	$(PY) -m pytest --doctest-modules asyncops -p no:cacheprovider

# API reference generated from the docstrings (HTML in docs/api/).
docs: $(STAMP)
	$(VENV)/bin/pdoc -o docs/api asyncops

lint: $(STAMP)
	$(VENV)/bin/ruff check asyncops tests examples benchmarks
	$(VENV)/bin/ruff format --check asyncops tests examples benchmarks

BENCH_ARGS ?=
bench: $(STAMP)
	$(PY) -m benchmarks.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV)
