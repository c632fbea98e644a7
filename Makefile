# Two commands set everything up: `make demo` (the main job) and `make test`. Each builds its virtual
# environment when it is missing or older than pyproject.toml, then runs.
PYTHON ?= python3
VENV := .venv
# The oldest supported JAX runs on the oldest supported Python when this machine has it.
OLDEST_VENV := .venv-oldest
OLDEST_CONSTRAINTS := .ci/oldest.txt
OLDEST_PYTHON ?= $(shell for p in python3.10 $$(pyenv root 2>/dev/null)/versions/3.10*/bin/python3.10; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null && { echo "$$p"; exit; }; done; \
	echo $(PYTHON))
PYTEST_ARGS ?=
# Test processes (pytest-xdist): one per core; TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= auto
DEMO_ARGS ?=
BENCH_ARGS ?=

.PHONY: test test-fast test-oldest demo bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test,demo]'
	touch $@

$(OLDEST_VENV)/.installed: pyproject.toml $(OLDEST_CONSTRAINTS)
	$(OLDEST_PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install --quiet -c $(OLDEST_CONSTRAINTS) -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/python -m autocast demo $(DEMO_ARGS)

bench: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/bench.py $(BENCH_ARGS)

test: $(VENV)/.installed
	$(VENV)/bin/python -c 'import sys, jax; print(f"python {sys.version.split()[0]}, jax {jax.__version__}")'
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The edit-test loop: everything but the tests marked slow (CI runs them all, with make test).
test-fast: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

test-oldest: $(OLDEST_VENV)/.installed
	$(OLDEST_VENV)/bin/python -c 'import sys, jax; print(f"python {sys.version.split()[0]}, jax {jax.__version__}")'
	$(OLDEST_VENV)/bin/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(OLDEST_VENV) .hypothesis
