# make setup: .venv with everything pinned; make run: the embedded default; make test: the suite.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
CONFIG  ?= configs/tiny-cpu.yaml
PYTEST_ARGS ?=
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.torch_extensions
export WANDB_MODE ?= offline

.PHONY: setup run test test-quick system-packages

setup: .venv/.done

.venv/.done: pyproject.toml requirements.lock constraints.txt
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	# torch first: the CPU wheel; anything else asking for torch would pull a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -r requirements.lock
	$(PIP) install -q -c constraints.txt --no-deps -e .
	@if $(PIP) list 2>/dev/null | grep -i '^nvidia-'; then \
	  echo "setup: refusing to finish: nvidia-* packages were installed (a CUDA torch slipped in)"; exit 1; fi
	touch $@

system-packages:
	@command -v mpirun >/dev/null || (apt-get update -qq && apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null)

run: setup
	.venv/bin/hpcr1 run $(CONFIG)

test: setup system-packages
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-quick: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)
