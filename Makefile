# Quick start: `make train` runs the main job, `make test` runs the tests. Each first builds
# a virtual environment in .venv with everything it needs (a CPU build of torch where the
# machine's pip finds one).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: setup train test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*) $(wildcard kernels/*.cu)
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet --no-build-isolation -e ".[test,lightning,hf]"
	touch $@

train: setup
	$(VENV)/bin/overlap train $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

bench: setup
	$(PY) benchmarks/compare.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info overlap/_C*.so
