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

# The package's dependencies and the extras the tests use, read from pyproject.toml.
EXTRAS := test lightning hf
export DEPENDENCIES := import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	print(" ".join(d for d in p["dependencies"] + [d for e in "$(EXTRAS)".split() for d in p["optional-dependencies"][e]]))

.PHONY: setup train test test-all bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*) $(wildcard kernels/*.cu)
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet "$(TORCH)" ninja
	# The dependencies install while the extension compiles: pip keeps one core busy unpacking
	# and byte-compiling, ninja MAX_JOBS more; one after the other left a core idle for half a
	# minute. The editable install itself takes no dependencies, so the two touch other files.
	$(PY) -m pip install --quiet $$($(PY) -c "$$DEPENDENCIES") & dependencies=$$!; \
	PATH="$(abspath $(VENV))/bin:$$PATH" MAX_JOBS=$(MAX_JOBS) $(PY) -m pip install --quiet --no-build-isolation \
		--no-deps -e . && wait $$dependencies
	# The checkout's modules byte-compiled once, here: pip compiles what it installs, not an
	# editable package, and where PYTHONDONTWRITEBYTECODE is set every interpreter the tests
	# start (about two hundred) compiled them again from source.
	$(PY) -m compileall -q overlap kernels tests benchmarks examples
	touch $@

train: setup
	$(VENV)/bin/overlap train $(ARGS)

# `make test` (what CI runs) leaves out the slow tier (tests marked `slow`: a wheel built and
# installed into a fresh environment, benchmark smoke runs, the conformance cases' FSDP2
# control, the GPU checks' rehearsal, elastic jobs that kill ranks or lose a node, compiled
# cases launched alone);
# `make test-all` runs everything, by hand before a release. Both print the 25 slowest
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
