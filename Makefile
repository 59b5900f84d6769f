# make setup: .venv with everything pinned; make run: the embedded default; make test: lint and the suite.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
CONFIG  ?= configs/tiny-cpu.yaml
PYTEST_ARGS ?=
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.torch_extensions
export WANDB_MODE ?= offline

.PHONY: setup run lint test test-quick system-packages

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
	# DeepSpeed compiles its CPU shared-memory collective op on first use (~45 s): do it now, not in a stage.
	$(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $@

# Open MPI and Slurm (slurm/local/install.sh, Open MPI first), shellcheck and Chromium for the tests.
system-packages:
	slurm/local/install.sh
	@command -v shellcheck >/dev/null && command -v chromium >/dev/null || \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends shellcheck chromium >/dev/null)

run: setup
	.venv/bin/hpcr1 run $(CONFIG)

# The one-way layers (pyproject's import-linter contract), then ruff's lint and format check.
lint: setup
	.venv/bin/lint-imports --no-cache
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

# Starts the local single-node Slurm the tests in tests/slurm submit to.
test: lint system-packages
	slurm/local/start.sh
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-quick: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)
