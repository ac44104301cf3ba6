# Quick start: `make train` runs the main job, `make test` runs the tests. Each first builds
# a virtual environment in .venv with everything it needs (a CPU build of torch where the
# machine's pip finds one).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
# The extension's sources compile in parallel through ninja (the venv's, found on PATH as
# torch's build looks for it; without it the sources compile one after another), this many at
# a time: one per core of a 2-core machine.
MAX_JOBS ?= 2

.PHONY: setup train test test-all bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*) $(wildcard kernels/*.cu)
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet "$(TORCH)" ninja
	PATH="$(abspath $(VENV))/bin:$$PATH" MAX_JOBS=$(MAX_JOBS) $(PY) -m pip install --quiet --no-build-isolation -e ".[test,lightning,hf]"
	# The checkout's modules byte-compiled once, here: pip compiles what it installs, not an
	# editable package, and where PYTHONDONTWRITEBYTECODE is set every interpreter the tests
	# start (about two hundred) compiled them again from source.
	$(PY) -m compileall -q overlap kernels tests benchmarks examples
	touch $@

train: setup
	$(VENV)/bin/overlap train $(ARGS)

# `make test` leaves out the slow tier (tests marked `slow`: a wheel built and installed into a
# fresh environment); `make test-all` runs everything, as CI does. Both print the 25 slowest
# tests, so every log shows where the time goes. The files run on TEST_WORKERS pytest-xdist
# workers, a whole file to a worker, in the order tests/conftest.py collects them (the longest
# files first; xdist's own reordering puts the files with most tests first): most tests wait on
# ranks that wait on each other, and one worker left a 2-core machine a third idle.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup
	$(PYTEST) -m "not slow" $(ARGS)

test-all: setup
	$(PYTEST) $(ARGS)

bench: setup
	$(PY) benchmarks/compare.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info overlap/_C*.so
