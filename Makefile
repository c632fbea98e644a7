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
# The newest supported JAX, on a Python >= 3.12 (JAX 0.11 on needs one): make test-newest
# finds one with .ci/newest_python.sh (NEWEST_PYTHON, python3.13/3.12 on PATH or under pyenv,
# else a Debian 13 root built once under .newest-root/). One venv per JAX version, so
# NEWEST_JAX=0.11.2 and the default keep theirs.
NEWEST_JAX ?= 0.12.0.1
NEWEST_VENV := .venv-newest-$(NEWEST_JAX)
NEWEST_PYTHON ?=
PYTEST_ARGS ?=
# Test processes (pytest-xdist): one per core; TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= auto
DEMO_ARGS ?=
BENCH_ARGS ?=
# make gpu-plan: GPU programs compiled on this machine, no GPU needed (benchmarks/gpu_plan.py).
# Its venv holds the JAX of .venv and the CUDA plugin of the same version (about 5.5 GB).
GPU_PLAN_VENV := .venv-gpu-plan
PLAN_ARGS ?=
# make tpu-plan: TPU programs compiled on this machine, no TPU needed (benchmarks/gpu_plan.py
# --target tpu). Its venv holds the JAX of .venv and the libtpu its jax[tpu] extra pins.
TPU_PLAN_VENV := .venv-tpu-plan
# A venv is made with pip, which then installs uv from the registry, and uv installs the
# project and its dependencies: uv is several times faster than pip with the same packages
# (docs/benchmarks.md, CI's time). --python names the venv whatever VIRTUAL_ENV the caller
# exported. uv reads none of pip's settings (an index, a certificate): where it cannot
# install, pip does. uv does not byte-compile; that is done on every core afterwards (where
# PYTHONDONTWRITEBYTECODE is set, as on this project's machines, no import writes bytecode,
# and every process would compile JAX's sources again). Left out: the packages' test folders
# and the installers, which the suite runs in one test at most. A file that does not compile
# is left without bytecode, and the build goes on.
# $(call install,VENV,WHAT): WHAT into VENV, by uv or else by pip
install = $(1)/bin/python -m pip install --quiet --disable-pip-version-check uv && \
	$(1)/bin/python -m uv pip install --quiet --python $(1)/bin/python $(2) || \
	{ $(1)/bin/python -m pip install --quiet --upgrade pip && \
	$(1)/bin/python -m pip install --quiet --no-compile $(2); }
BYTECODE := -m compileall -q -j 0 -x '/tests?/|/site-packages/(pip|setuptools|uv)/'

# What each venv installs.
VENV_WHAT := -e '.[test,demo]'
OLDEST_WHAT := -c $(OLDEST_CONSTRAINTS) -e '.[test]'
NEWEST_WHAT = jax==$(NEWEST_JAX) jaxlib==$(NEWEST_JAX) -e '.[test,demo]'
GPU_PLAN_WHAT := "jax==$$v" "jaxlib==$$v" "jax-cuda12-plugin[with-cuda]==$$v" flax -e '.[demo]'
TPU_PLAN_WHAT := "jax[tpu]==$$v" "jaxlib==$$v" flax -e '.[test,demo]'

# What the scripts test-newest runs read, wherever they were given (command line or environment).
export NEWEST_JAX NEWEST_PYTHON TEST_WORKERS PYTEST_ARGS

.PHONY: test test-fast test-oldest test-newest newest-suite demo bench gpu-plan tpu-plan docs clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(call install,$(VENV),$(VENV_WHAT))
	$(VENV)/bin/python $(BYTECODE) $(VENV)/lib || true
	touch $@

$(OLDEST_VENV)/.installed: pyproject.toml $(OLDEST_CONSTRAINTS)
	$(OLDEST_PYTHON) -m venv $(OLDEST_VENV)
	$(call install,$(OLDEST_VENV),$(OLDEST_WHAT))
	$(OLDEST_VENV)/bin/python $(BYTECODE) $(OLDEST_VENV)/lib || true
	touch $@

# Built by newest-suite with the interpreter .ci/newest_python.sh chose (it empties the venv
# when that changes); the pins keep the resolver on the JAX under test.
$(NEWEST_VENV)/.installed: pyproject.toml
	@test -n "$(NEWEST_PYTHON)" || { echo "run make test-newest: it finds a Python >= 3.12"; exit 2; }
	$(NEWEST_PYTHON) -m venv $(NEWEST_VENV)
	$(call install,$(NEWEST_VENV),$(NEWEST_WHAT))
	$(NEWEST_VENV)/bin/python $(BYTECODE) $(NEWEST_VENV)/lib || true
	touch $@

$(GPU_PLAN_VENV)/.installed: $(VENV)/.installed
	$(PYTHON) -m venv $(GPU_PLAN_VENV)
	v=$$($(VENV)/bin/python -c 'import jax; print(jax.__version__)') && \
	$(call install,$(GPU_PLAN_VENV),$(GPU_PLAN_WHAT))
	$(GPU_PLAN_VENV)/bin/python $(BYTECODE) $(GPU_PLAN_VENV)/lib || true
	touch $@

$(TPU_PLAN_VENV)/.installed: $(VENV)/.installed
	$(PYTHON) -m venv $(TPU_PLAN_VENV)
	v=$$($(VENV)/bin/python -c 'import jax; print(jax.__version__)') && \
	$(call install,$(TPU_PLAN_VENV),$(TPU_PLAN_WHAT))
	$(TPU_PLAN_VENV)/bin/python $(BYTECODE) $(TPU_PLAN_VENV)/lib || true
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/python -m autocast demo $(DEMO_ARGS)

bench: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/bench.py $(BENCH_ARGS)

# The pages made from the code: docs/api.md, the table of docs/default_policy.md and
# docs/support_matrix.md (tests check each against the code).
docs: $(VENV)/.installed
	$(VENV)/bin/python tests/docs_pages.py

gpu-plan: $(GPU_PLAN_VENV)/.installed
	$(GPU_PLAN_VENV)/bin/python benchmarks/gpu_plan.py $(PLAN_ARGS)

tpu-plan: $(TPU_PLAN_VENV)/.installed
	$(TPU_PLAN_VENV)/bin/python benchmarks/tpu_products.py
	$(TPU_PLAN_VENV)/bin/python benchmarks/gpu_plan.py --target tpu $(PLAN_ARGS)

test: $(VENV)/.installed
	$(VENV)/bin/python -c 'import sys, jax; print(f"python {sys.version.split()[0]}, jax {jax.__version__}")'
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The edit-test loop: ruff on the Python files changed since the last commit, then everything
# but the tests marked slow (CI runs them all, with ruff over the tree, in make test).
test-fast: $(VENV)/.installed
	@changed="$$( { git diff --name-only --diff-filter=d HEAD -- '*.py'; \
		git ls-files --others --exclude-standard -- '*.py'; } 2>/dev/null | sort -u)"; \
	if [ -n "$$changed" ]; then \
		echo "ruff on $$(echo $$changed | wc -w) changed file(s)"; \
		$(VENV)/bin/ruff check $$changed && $(VENV)/bin/ruff format --check $$changed; \
	fi
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

# The oldest and the newest JAX run every test but those marked once, which make test runs:
# long training runs, benchmark scripts and the wheel's install, whose verdict does not hinge
# on the JAX version, bigger repeats of what a cheaper test checks on every JAX, and three
# quarters of the support matrix's cube.
test-oldest: $(OLDEST_VENV)/.installed
	$(OLDEST_VENV)/bin/python -c 'import sys, jax; print(f"python {sys.version.split()[0]}, jax {jax.__version__}")'
	$(OLDEST_VENV)/bin/python -m pytest -n $(TEST_WORKERS) -m "not once" $(PYTEST_ARGS)

test-newest:
	@.ci/newest_python.sh $(MAKE)

# The suite in $(NEWEST_VENV), run by test-newest once it has a Python (inside the Debian root
# where it made one); it stops if the venv holds another JAX than the one asked for.
newest-suite: $(NEWEST_VENV)/.installed
	$(NEWEST_VENV)/bin/python -c 'import sys, jax; print(f"python {sys.version.split()[0]}, jax {jax.__version__}"); \
		assert jax.__version__ == "$(NEWEST_JAX)", "$(NEWEST_VENV) holds another JAX"'
	$(NEWEST_VENV)/bin/python -m pytest -n $(TEST_WORKERS) -m "not once" $(PYTEST_ARGS)

# Leaves the Debian root (.newest-root/) alone: it takes minutes to build and is reused.
clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(GPU_PLAN_VENV) .venv-newest-* .hypothesis
