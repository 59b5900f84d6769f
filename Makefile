# make setup: .venv with everything pinned; make run: the embedded default; make test: lint and the suite.
# make test-twin: verl's megatron backend on CPU in .venv-twin (make setup-twin), the GPU lock's versions.
# make setup-gpu: .venv-gpu for GPU nodes (CUDA torch, vLLM, verl), from requirements-gpu.lock.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
CONFIG  ?= configs/tiny-cpu.yaml
PYTEST_ARGS ?=
# The tests run in TEST_WORKERS pytest-xdist workers (tests/conftest.py keeps a module, or the modules
# sharing a service, in one; the longest go first). 3 on this 2-vCPU machine kind: two of them spend
# most of the run waiting on Slurm jobs, whose Ray and ranks leave a core idle (bench/RESULTS.md).
# TEST_WORKERS=1: one process, in pytest's own order.
TEST_WORKERS ?= 3
XDIST   := $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder)
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.torch_extensions
export WANDB_MODE ?= offline
# A download cut short resumes rather than failing the setup (torch's 530 MB wheel was, once).
export PIP_RESUME_RETRIES ?= 10

.PHONY: setup setup-gpu setup-twin run lint test test-verl test-twin test-quick system-packages

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

# A venv of its own: verl's vllm extra and vLLM pin torch 2.11.0 (PyPI's CUDA 13 build), not .venv's
# CPU torch 2.13.0, and `setup` refuses nvidia-* packages. Its .gitignore keeps git and ruff out of it.
# The locks are resolved for Linux x86_64 CPython 3.12 (tests/unit/test_gpu_lock.py): PYTHON must be 3.12.
# requirements-gpu-nodeps.lock comes after the check, without dependencies: Megatron-Bridge (its
# header says why), then Transformer Engine's torch extension and flash-attn, compiled here against
# the installed torch. Those two need a CUDA 13 toolkit in CUDA_HOME (its nvcc); cuDNN's,
# cudnn-frontend's, NCCL's and cuBLAS's headers also come from the lock's wheels (GPU_CPATH). The torch
# extension is C++ (28 min on 2 cores); flash-attn's CUDA kernels build for four GPU generations unless
# FLASH_ATTN_CUDA_ARCHS=80 (A100s only, far sooner). MAX_JOBS bounds the compilers' memory.
# NVTE_PYTORCH_FORCE_BUILD, FLASH_ATTENTION_FORCE_BUILD: compile, never fetch a prebuilt wheel.
PYTHON  ?= python3
GPU_PIP := .venv-gpu/bin/pip
NODEPS  := requirements-gpu-nodeps.lock
pin      = $(shell grep -i '^$(1)==' $(NODEPS))
GPU_SITE = .venv-gpu/lib/python3.12/site-packages
S        = $(CURDIR)/$(GPU_SITE)
GPU_CPATH = $(S)/nvidia/cudnn/include:$(S)/nvidia/nccl/include:$(S)/include:$(S)/nvidia/cu13/include

setup-gpu: .venv-gpu/.done

.venv-gpu/.done: requirements-gpu.lock $(NODEPS) pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' || \
	  (echo "setup-gpu: requirements-gpu.lock is for CPython 3.12 ($(PYTHON) is not); run with PYTHON=python3.12"; exit 1)
	@"$(CUDA_HOME)/bin/nvcc" --version 2>/dev/null | grep -q 'release 13\.' || \
	  (echo "setup-gpu: Transformer Engine's torch extension and flash-attn compile with CUDA 13, and" \
	   "CUDA_HOME='$(CUDA_HOME)' holds no CUDA 13 nvcc: on Perlmutter \`module load cudatoolkit\` at a" \
	   "13.x version (\`module avail cudatoolkit\`), which sets CUDA_HOME; elsewhere set it"; exit 1)
	$(PYTHON) -m venv .venv-gpu
	echo '*' > .venv-gpu/.gitignore
	$(GPU_PIP) install -q --upgrade pip
	# No constraints.txt here: it pins the CPU torch. The lock holds every package, so pip adds none.
	$(GPU_PIP) install -q -r requirements-gpu.lock
	# On a rerun, the last run's Megatron-Bridge would fail the check (it is installed without its deps).
	$(GPU_PIP) uninstall -q -y megatron-bridge
	$(GPU_PIP) check
	$(GPU_PIP) install -q --no-deps $(call pin,megatron-bridge)
	CPATH=$(GPU_CPATH)$${CPATH:+:$$CPATH} NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE \
	  $(GPU_PIP) install --no-deps --no-build-isolation $(call pin,transformer-engine-torch)
	FLASH_ATTENTION_FORCE_BUILD=TRUE $(GPU_PIP) install --no-deps --no-build-isolation $(call pin,flash-attn)
	# --no-deps, and after the check: pyproject.toml's pins are the CPU side's (torch, transformers).
	$(GPU_PIP) install -q --no-deps -e .
	# Works on a login node (no GPU): a torch without CUDA here would mean the wrong wheel came in. The
	# modules are those launch/verl_job.py asks of the jobs' Python for verl's megatron backend (found,
	# not imported: Transformer Engine loads libcuda, the driver's, on import).
	.venv-gpu/bin/python -c "import torch; from importlib.metadata import version as v; \
	  from importlib.util import find_spec; assert torch.version.cuda, 'a CPU torch'; \
	  assert all(map(find_spec, ['megatron.bridge', 'transformer_engine_torch', 'flash_attn'])); \
	  print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'vllm', v('vllm'), 'verl', v('verl'), \
	        'megatron-bridge', v('megatron-bridge'), 'flash-attn', v('flash-attn'))"
	touch $@

# make setup-twin: .venv-twin, the CPU twin of .venv-gpu: the GPU lock's versions (verl, megatron-core,
# Megatron-Bridge, transformers, torch 2.11's PyPI build, which runs on CPU too) on Python 3.12, less
# what only runs on a GPU (vLLM, flashinfer, and the nodeps lock's two compiled extensions). Here verl's
# megatron backend executes on the CPU platform at the versions a GPU job runs (tests marked `twin`).
# TWIN_PYTHON: a CPython 3.12; these machines have pyenv's. Without one: `pyenv install 3.12` or
# `uv python install 3.12`, then TWIN_PYTHON=<its python3.12>.
# (pyenv's shim answers `command -v` even where 3.12 is not selected, so its versions come first)
TWIN_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12))
TWIN_PIP    := .venv-twin/bin/pip
TWIN_SKIP   := vllm|flashinfer-python|flashinfer-cubin|transformer_engine\[core_cu13\]|transformer_engine_cu13

setup-twin: .venv-twin/.done

.venv-twin/.done: requirements-gpu.lock $(NODEPS) pyproject.toml
	@"$(TWIN_PYTHON)" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null || \
	  (echo "setup-twin: needs a CPython 3.12 (TWIN_PYTHON='$(TWIN_PYTHON)' is not one): pyenv install 3.12" \
	   "or uv python install 3.12, then make setup-twin TWIN_PYTHON=<its python3.12>"; exit 1)
	"$(TWIN_PYTHON)" -m venv .venv-twin
	echo '*' > .venv-twin/.gitignore
	$(TWIN_PIP) install -q --upgrade pip
	grep -v -E '^($(TWIN_SKIP))==' requirements-gpu.lock > .venv-twin/requirements.txt
	# The lock holds every package: without dependencies pip takes exactly its pins.
	$(TWIN_PIP) install -q --no-deps -r .venv-twin/requirements.txt
	$(TWIN_PIP) install -q --no-deps $(call pin,megatron-bridge)
	$(TWIN_PIP) install -q --no-deps -e .
	touch $@

# Open MPI and Slurm (slurm/local/install.sh, Open MPI first), shellcheck and Chromium for the tests,
# and podman with the image the container tests run stages in (tests/support/podman_image.sh).
system-packages:
	slurm/local/install.sh
	@command -v shellcheck >/dev/null && command -v chromium >/dev/null || \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends shellcheck chromium >/dev/null)
	@command -v podman >/dev/null && command -v runc >/dev/null && command -v debootstrap >/dev/null || \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null)
	tests/support/podman_image.sh

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
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# Only verl's own trainer and generation through the five-stage chain and across two nodes, on the
# CPU platform (part of `make test` too).
test-verl: lint system-packages
	slurm/local/start.sh
	$(PY) -m pytest -q -m verl_chain $(PYTEST_ARGS)

# verl's megatron backend on the CPU platform at the GPU lock's versions (tests/twin, in .venv-twin;
# `make test` skips them, its venv lacking Megatron-Bridge). .ci/run runs it after `make test`.
test-twin: setup-twin
	.venv-twin/bin/python -m pytest -q -m twin tests/twin $(PYTEST_ARGS)

# The quick subset. Its tests need shellcheck, Chromium, Open MPI and scontrol: they fail, not skip, without them.
test-quick: setup system-packages
	$(PY) -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS)
